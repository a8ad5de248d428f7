"""A testing tool: corrupt one value of one module's output on one rank at one step
(`--inject-corrupt SPEC`, or the environment's `MEGAPAR_INJECT_CORRUPT`).

SPEC is comma-separated key=value pairs:

    step=3,module=transformer.h.3.attn,tp=1[,cp=0][,dp=0][,pp=P][,mb=0][,index=0][,value=nan]

`module` is a transformers name of the export (`module_trace.hf_modules`); the value at flat
`index` of its output in micro-batch `mb` of step `step` becomes `value` (nan, inf, -inf or a
number) on the rank with those tp / cp / dp coordinates (and pp: by default wherever the module
lives). The same value is corrupted when the module's forward is recomputed (activation
recomputation) and when the step runs again (`nonfinite.locate`, a replay), so the step is the
same each time it runs.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from megapar.diagnostics.module_trace import hf_modules
from megapar.faults.stop import RunStopped
from megapar.mesh import Layout, Mesh
from megapar.pipeline.partition import build_stage

ENV = "MEGAPAR_INJECT_CORRUPT"
"""The environment variable that may hold the spec instead of the flag."""

EXAMPLE = "step=3,module=transformer.h.3.attn,tp=1"


@dataclass(frozen=True)
class CorruptSpec:
    """Which value to corrupt, and to what."""

    step: int
    """The step (1 = the first)."""
    module: str
    """The module's transformers name."""
    tp: int = 0
    cp: int = 0
    dp: int = 0
    pp: int | None = None
    """The rank's pipeline stage (None: wherever the module lives)."""
    mb: int = 0
    """The micro-batch (of this rank)."""
    index: int = 0
    """The flat index into the module's output."""
    value: float = math.nan
    """What the value becomes."""


def parse(spec: str, flag: str = "--inject-corrupt") -> CorruptSpec:
    """SPEC -> CorruptSpec; ValueError naming the problem and the fix."""
    fields: dict = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in CorruptSpec.__dataclass_fields__:
            raise ValueError(
                f"{flag} {spec!r}: {part!r} is not KEY=VALUE with KEY one of step, "
                f"module, tp, cp, dp, pp, mb, index, value; e.g. {EXAMPLE}"
            )
        if key in fields:
            raise ValueError(f"{flag} {spec!r}: {key} is given twice; give it once")
        try:
            if key == "module":
                fields[key] = value.strip()
            elif key == "value":
                fields[key] = float(value)
            else:
                fields[key] = int(value)
        except ValueError:
            raise ValueError(
                f"{flag} {spec!r}: {key}={value} is not a "
                f"{'number (nan, inf, -inf, 1e4)' if key == 'value' else 'whole number'}"
                f"; e.g. {EXAMPLE}"
            ) from None
    missing = [k for k in ("step", "module") if k not in fields]
    if missing:
        raise ValueError(f"{flag} {spec!r}: {' and '.join(missing)} missing; e.g. {EXAMPLE}")
    out = CorruptSpec(**fields)
    negative = [k for k in ("tp", "cp", "dp", "mb", "index") if getattr(out, k) < 0]
    if out.step < 1 or negative or (out.pp is not None and out.pp < 0):
        raise ValueError(
            f"{flag} {spec!r}: step must be >= 1 and coordinates, mb and index >= 0; e.g. {EXAMPLE}"
        )
    return out


def _held(config) -> list[tuple[nn.Module, str]]:
    """(module, transformers name) of the whole model's named modules, in registration order."""
    stage = build_stage(config, Mesh.virtual(Layout(1, 1, 1)), seed=0, init=False)
    return [(module, name) for _, module, name in hf_modules(stage, config)]


def module_names(config) -> list[str]:
    """The module names a spec may give: the model's, as its Hugging Face export names them."""
    return sorted({name for _, name in _held(config)})


def runs_no_forward(name: str, held: list[tuple[nn.Module, str]]) -> str | None:
    """Why `name`'s output is never made, where none of its modules has a forward of its own
    (an untied LM head is a holder of the weight that the loss takes into its fused
    vocabulary-parallel cross-entropy), naming the module before it; None where one has."""
    modules = [m for m, n in held if n == name]
    if not modules or any(type(m).forward is not nn.Module.forward for m in modules):
        return None
    first = next(i for i, (_, n) in enumerate(held) if n == name)
    before = [n for m, n in held[:first] if type(m).forward is not nn.Module.forward]
    instead = f"; corrupt the module before it, {before[-1]}" if before else ""
    return (
        f"{name} has no forward in megapar: the loss takes its weight into a fused "
        f"vocabulary-parallel cross-entropy, which makes the logits in chunks and keeps "
        f"none{instead}"
    )


def check(
    spec: str,
    config,
    layout: Layout,
    micro_batches: int | None = None,
    flag: str = "--inject-corrupt",
    tokens: int | None = None,
) -> CorruptSpec:
    """Parse `spec` and check it against the model and the layout (before any worker starts):
    a module name the export does not have is refused with the names closest to it, and with
    `tokens` (a micro-batch's: micro-batch size x seq-len) an index past any module's output
    (at most `tokens` x the widest output: the worker checks the module's own)."""
    out = parse(spec, flag)
    held = _held(config)
    names = sorted({name for _, name in held})
    if out.module not in names:
        close = difflib.get_close_matches(out.module, names, n=5, cutoff=0.5)
        hint = (
            f"did you mean {', '.join(close)}?"
            if close
            else f"the model's modules are e.g. {', '.join(names[:4])}"
        )
        raise ValueError(
            f"{flag}: {config.model_type} has no module {out.module!r} (names as in "
            f"the Hugging Face export); {hint}"
        )
    if why := runs_no_forward(out.module, held):  # (it corrupted nothing; a re-test)
        raise ValueError(f"{flag}: {why}")
    for axis in ("tp", "cp", "dp", "pp"):
        value, size = getattr(out, axis), getattr(layout, axis)
        if value is not None and value >= size:
            raise ValueError(
                f"{flag}: {axis}={value} is outside the layout's {axis} {size}; "
                f"choose {axis} < {size}"
            )
    if micro_batches is not None and out.mb >= micro_batches:
        raise ValueError(
            f"{flag}: mb={out.mb} but each rank runs {micro_batches} micro-batches "
            f"per step; choose mb < {micro_batches}"
        )
    if tokens is not None:
        widest = max(
            4 * config.hidden_size,
            2 * config.ffn_size,
            config.vocab_size + getattr(config, "make_vocab_size_divisible_by", 128) * layout.tp,
        )
        if out.index >= tokens * widest:
            raise ValueError(
                f"{flag}: index={out.index} is past any module's output on a rank "
                f"(at most {tokens * widest:,} values: {tokens} tokens of a "
                f"micro-batch x {widest:,} features); choose a smaller index"
            )
    return out


def from_settings(spec: str | None) -> str:
    """The spec in effect: the flag's, else the environment's ("" for none)."""
    return spec or os.environ.get(ENV, "")


class CorruptInjector:
    """The forward hooks that corrupt the value on this rank (none on other ranks)."""

    def __init__(self, spec: CorruptSpec, stage, config, mesh):
        self.spec = spec
        self.current = None  # (action kind, micro-batch) while an armed step runs
        self.fired = 0
        """How often the value was corrupted (forwards, recomputations and re-runs)."""
        coords = (mesh.tp_rank, mesh.cp_rank, mesh.dp_rank)
        here = coords == (spec.tp, spec.cp, spec.dp) and spec.pp in (None, mesh.pp_rank)
        held = [(m, name) for _, m, name in hf_modules(stage, config)]
        self.modules = [m for m, name in held if here and name == spec.module]
        if here and spec.pp is not None and not self.modules:  # (it corrupted nothing and
            known = set(module_names(config))  # the run passed; a new user's finding): the
            names = [name for _, name in held if name in known]  # names a spec may give
            holds = f"it holds {names[0]} to {names[-1]}" if names else "it holds none"
            raise ValueError(
                f"--inject-corrupt: {spec.module} is not on pp stage {spec.pp} ({holds}); "
                f"give the pp= of the stage that holds it, or leave pp= out"
            )
        for module in self.modules:
            module.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self.current is None or self.current[1] != self.spec.mb:
            return None
        out = output if isinstance(output, torch.Tensor) else output[0]
        flat = out.detach().reshape(-1)
        if self.spec.index >= flat.numel():
            raise ValueError(
                f"--inject-corrupt: index={self.spec.index} is outside "
                f"{self.spec.module}'s output of {flat.numel()} values on this "
                f"rank; choose index < {flat.numel()}"
            )
        corrupted = out.clone()  # (its strides kept: a Qwen3 q_norm's output is no view's)
        corrupted[torch.unravel_index(torch.tensor(self.spec.index), out.shape)] = self.spec.value
        self.fired += 1
        return corrupted if isinstance(output, torch.Tensor) else (corrupted, *output[1:])

    @contextlib.contextmanager
    def armed(self, executor, step: int):
        """Inside the block, `executor` runs `step`: the hooks fire in its actions of the
        spec's micro-batch when `step` is the spec's."""
        if step != self.spec.step or not self.modules:
            yield
            return
        saved = dict(executor.handlers)

        def wrap(kind, handler, action):
            self.current = (kind, action.mb)
            try:
                handler(action)
            finally:
                self.current = None

        for kind, handler in saved.items():
            executor.handlers[kind] = functools.partial(wrap, kind, handler)
        before = self.fired
        try:
            yield
        finally:
            executor.handlers.clear()
            executor.handlers.update(saved)
        if self.fired == before:  # the step ran without calling the module (a BERT's
            raise RunStopped(  # cls.predictions: its features are called; a re-test)
                f"--inject-corrupt: {self.spec.module} made no output in micro-batch "
                f"{self.spec.mb} of step {step} on this rank (megapar calls a part of it, or "
                f"routed it no token), so nothing was corrupted; choose a module inside it "
                f"or another micro-batch"
            )
