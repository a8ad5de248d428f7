"""Evaluate a megapar checkpoint with lm-evaluation-harness (pip install -e ".[eval]").

    python examples/lm_eval_checkpoint.py CKPT                      # a tiny local task, offline
    python examples/lm_eval_checkpoint.py CKPT --tasks hellaswag    # any lm-eval task you have
    python examples/lm_eval_checkpoint.py CKPT --tokenizer gpt2     # one that records none

The recipe is two commands; this script runs them and, by default, builds a tiny perplexity
task from the Shakespeare sample shipped with megapar, so it works without a network:

    megapar-convert CKPT --to-hf exported/     # weights, config and the training tokenizer
    lm_eval --model hf --model_args pretrained=exported/,dtype=float32 --tasks ... --device cpu

`pretrained=DIR` alone is enough: the export carries its tokenizer (AutoTokenizer loads it),
where the checkpoint records one: megapar-train's do, and `engine.save`'s where the model was
prepared from a directory or checkpoint that holds one. For one that records none, --tokenizer
names the tokenizer the model trained with (megapar-convert's flag); without it the script stops
(lm-eval would score every document on zero tokens: perplexity 1.0).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

TASK = "megapar_shakespeare_tiny"
"""The local task: rolling log-likelihood (word / byte perplexity, bits per byte) of documents."""


def export(ckpt: str | Path, out: Path, tokenizer: str | None = None) -> Path:
    """`megapar-convert CKPT --to-hf OUT [--tokenizer SPEC]`; returns OUT. Stops with one line
    when the export holds no tokenizer (the checkpoint records none and `tokenizer` is None)."""
    from megapar.cli.convert import main as convert

    extra = ["--tokenizer", tokenizer] if tokenizer else []
    shutil.rmtree(out, ignore_errors=True)  # this script's own: no file of an earlier export
    code = convert([str(ckpt), "--to-hf", str(out), "--overwrite", *extra])
    if code != 0:  # megapar-convert printed the one line naming the problem
        raise SystemExit(code)
    if not (out / "tokenizer_config.json").exists():  # AutoTokenizer would load an empty one
        fail(f"{ckpt} records no tokenizer, so its export has none and lm-eval would score "
             f"every document on zero tokens; pass --tokenizer SPEC, the tokenizer the model "
             f"trained with (e.g. --tokenizer gpt2)")
    return out


def fail(message: str) -> None:
    """Stop with one line, `lm_eval_checkpoint.py: error: MESSAGE`, and exit status 2."""
    print(f"lm_eval_checkpoint.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def unknown_tasks(manager, tasks: list[str]) -> list[str]:
    """The names in `tasks` that lm-eval's `manager` knows no task, group or tag by (a name, a
    glob pattern, or a task YAML file that exists)."""
    return [t for t in tasks if not manager.match_tasks([t])
            and not (t.endswith(".yaml") and Path(t).is_file())]


def local_task(directory: Path, docs: list[str]) -> Path:
    """Write `TASK` (its YAML and a JSON-lines file of `docs`) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: loglikelihood_rolling\n"
        "doc_to_text: \"\"\n"
        "doc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n")
    return directory


def evaluate(ckpt: str | Path, work: str | Path, docs: list[str] | None = None,
             tasks: list[str] | None = None,
             tokenizer: str | None = None) -> tuple[dict, list[float]]:
    """Export `ckpt` (with `tokenizer`, where it records none) into WORK/exported and run
    lm-eval's `hf` model on `tasks` (default: the local task over `docs`, or paragraphs of the
    shipped sample). Returns lm-eval's results and, for the local task, each document's
    log-likelihood."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    work = Path(work)
    if tasks:  # checked before the export: an unknown name was KeyError's traceback after it
        manager = TaskManager()
        unknown = unknown_tasks(manager, tasks)
        if unknown:
            fail(f"lm-eval has no task {', '.join(map(repr, unknown))}; `lm-eval ls tasks` "
                 f"lists the names (or pass the path of a task's .yaml file)")
    else:
        if docs is None:
            from megapar.data import asset_path

            text = Path(asset_path("shakespeare_sample.txt")).read_text()
            docs = [p.strip() for p in text.split("\n\n") if 100 < len(p.strip()) < 400][:16]
        manager = TaskManager(include_path=str(local_task(work / "task", docs)))
        tasks = [TASK]
    exported = export(ckpt, work / "exported", tokenizer)
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={exported},dtype=float32", tasks=tasks,
        task_manager=manager, batch_size=1, device="cpu", log_samples=True)
    per_doc = [float(s["resps"][0][0]) for s in sorted(results["samples"].get(TASK, []),
                                                       key=lambda s: s["doc_id"])]
    return results, per_doc


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt", help="a checkpoint written by megapar-train --save")
    parser.add_argument("--work", default="lm_eval_work", help="where the export and task go")
    parser.add_argument("--tasks", nargs="+", help="lm-eval tasks (default: the local one)")
    parser.add_argument("--tokenizer", help="the tokenizer the model trained with, for a "
                        "checkpoint that records none (megapar-convert --tokenizer: 'gpt2', a "
                        "tokenizer.json directory, ...)")
    args = parser.parse_args(argv)
    missing = [m for m in ("lm_eval", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:  # before the export: lm-eval's hf model needs both
        print(f"lm_eval_checkpoint.py: error: {' and '.join(missing)} not installed: pip "
              f"install -e '.[eval]' in the checkout (or pip install 'lm-eval[hf]')",
              file=sys.stderr)
        sys.exit(2)
    from megapar.checkpoint.format import CheckpointError
    from megapar.checkpoint.publish import resolve_checkpoint

    try:  # before lm-eval's task index (seconds) and the export
        resolve_checkpoint(args.ckpt)
    except CheckpointError as exc:
        fail(str(exc))
    results, _ = evaluate(args.ckpt, args.work, tasks=args.tasks, tokenizer=args.tokenizer)
    print(json.dumps(results["results"], indent=1, default=str))


if __name__ == "__main__":
    main()
