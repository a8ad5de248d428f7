"""The layouts a plan considers: every (tp, cp, pp, dp, ep, micro-batch size, schedule, V,
recompute, SP, ZeRO stage, offload) for N GPUs, each kept or rejected with the reason (ep, for
a mixture-of-experts model only: each divisor of dp that divides the experts).

A `Candidate` is one such choice; `check(candidate, problem)` returns why it cannot run (or None),
`enumerate_candidates` walks the whole space. `parse_candidate("tp=8,pp=16,mbs=1,...")` reads
the `--explain` syntax.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass

from megapar.context_parallel import method_for
from megapar.context_parallel.a2a import heads_error
from megapar.data_parallel.sharded_params import REDUCES
from megapar.mesh import Layout, LayoutError, tp_spans_nodes
from megapar.models.blocks import CP_COMM_TYPES
from megapar.models.flops import heads
from megapar.one_line_parser import FALSE_WORDS, TRUE_WORDS
from megapar.pipeline.partition import (
    EMBEDDING_FLAG,
    FIRST_FLAG,
    LAST_FLAG,
    LOSS_FLAG,
    split_layers,
)
from megapar.pipeline.placement import CHUNKED_SCHEDULES, placement_of, schedules_taking
from megapar.pipeline.schedules import (
    SPLIT_BACKWARD,
    interleaved_rounds,
    schedule_named_elsewhere,
)
from megapar.plan.fp8 import fp8_refusal
from megapar.plan.problem import Problem
from megapar.training.validate import check_cp_seq_len, pps_taken, tps_taken
from megapar.wording import or_list

PLAN_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-v", "dualpipev")
"""Schedules the planner models. Those registered in `megapar.pipeline.schedules.SCHEDULES` are
simulated (and can be passed to megapar-train); the others use their published bubble formula."""
RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages the planner models: 1 the optimizer state sharded over dp x cp, 2 also the
gradients, 3 also the parameters (FSDP)."""
CP_COMMS = tuple(CP_COMM_TYPES)
"""megapar-train's --cp-comm-type values: auto, p2p (ring), all_gather, a2a (all-to-all)."""
OFFLOADS = ("none", "optimizer", "both")
"""What a plan may keep in host memory: the optimizer (--offload-optimizer), ZeRO-3's parameter
shards (--offload-params), or both."""


def regathers(p, c: Candidate) -> bool:
    """Whether `--sp-regather` (`Problem.sp_regather`) keeps the column-parallel inputs as
    sequence slices in candidate `c`: under SP at tp > 1, not under full recomputation nor a
    schedule that defers weight gradients (ZB-H1, ZB-V, DualPipeV: their store keeps the
    gathered input until W), where the layers keep the gathered input as without the flag."""
    return bool(
        p.sp_regather
        and c.sp
        and c.tp > 1
        and c.recompute != "full"
        and c.schedule not in SPLIT_BACKWARD
    )


@dataclass(frozen=True)
class Candidate:
    """One layout and its memory / schedule options."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline stages."""
    dp: int = 1
    """Data-parallel replicas; 0 where none fills the GPUs (`parse_candidate` of a layout that
    names no dp, for --gpus that tp x cp x pp does not divide): `check` refuses it, `label`
    names no dp."""
    mbs: int = 1
    """Micro-batch size (sequences)."""
    schedule: str = "1f1b"
    """Pipeline schedule (one of PLAN_SCHEDULES)."""
    v: int = 1
    """Model chunks per rank (interleaved 1F1B); 1 otherwise."""
    recompute: str = "none"
    """Activation recomputation: none, selective or full."""
    sp: bool = False
    """Sequence parallelism (splits LayerNorm / dropout activations over tp)."""
    zero: int = 0
    """ZeRO stage over cp x dp: 1 the optimizer state, 2 also the gradients, 3 also the
    parameters (`ZERO_STAGES`)."""
    cp: int = 1
    """Context-parallel size: ranks that split every sequence."""
    offload_optimizer: bool = False
    """The optimizer state and fp32 host copies of the stepped tensors in host memory."""
    offload_params: bool = False
    """ZeRO-3's parameter shards in host memory."""
    keep_params: bool = False
    """ZeRO-3 with pp: the stage's gathered parameters kept across its micro-batches."""
    zero3_reduce: str = "step"
    """ZeRO-3: when gradients are reduce-scattered (--zero3-reduce: step or micro-batch)."""
    ep: int = 1
    """Expert-parallel size (folded into dp x cp: it divides dp x cp): ranks that split each
    MoE layer's routed experts and exchange tokens by all-to-all."""
    etp: int = 1
    """Expert tensor-parallel size (megapar-train's --expert-tensor-parallel-size): 1 (each
    routed expert whole on every tp rank) or tp (each split over the tp ranks)."""
    cp_comm: str = "auto"
    """Context-parallel attention (megapar-train's --cp-comm-type, `CP_COMMS`): auto (the
    model's own: a ring of K/V blocks, an all-gather of them for grouped-query heads), p2p (the
    ring), all_gather or a2a (all-to-all, Ulysses: heads traded for the whole sequence)."""

    def label(self) -> str:
        sched = self.schedule + (f" v{self.v}" if self.v > 1 else "")
        extras = (
            [f"rc={self.recompute}"]
            + (["sp"] if self.sp else [])
            + ([f"zero{self.zero}"] if self.zero else [])
            + (["keep"] if self.keep_params else [])
            + (["rs/micro-batch"] if self.zero3_reduce != "step" else [])
            + ([f"offload={self.offloaded()}"] if self.offloaded() != "none" else [])
            + ([self.cp_comm] if self.cp_comm != "auto" else [])
        )
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        ep += f" etp{self.etp}" if self.etp > 1 else ""
        dp = f" dp{self.dp}" if self.dp else ""
        return f"tp{self.tp}{cp} pp{self.pp}{dp}{ep} mbs{self.mbs} {sched} " + " ".join(extras)

    def spec(self) -> str:
        """The --explain syntax for this candidate."""
        cp = f",cp={self.cp}" if self.cp > 1 else ""
        ep = f",ep={self.ep}" if self.ep > 1 else ""
        ep += f",etp={self.etp}" if self.etp > 1 else ""
        return (
            f"tp={self.tp}{cp},pp={self.pp},dp={self.dp}{ep},mbs={self.mbs},"
            f"schedule={self.schedule},v={self.v},recompute={self.recompute},"
            f"sp={int(self.sp)},zero={self.zero}"
            + (f",offload={self.offloaded()}" if self.offloaded() != "none" else "")
            + (",keep_params=1" if self.keep_params else "")
            + (f",zero3_reduce={self.zero3_reduce}" if self.zero3_reduce != "step" else "")
            + (f",cp_comm={self.cp_comm}" if self.cp_comm != "auto" else "")
        )

    def offloaded(self) -> str:
        """What is in host memory, as `OFFLOADS` names it."""
        return {
            (False, False): "none",
            (True, False): "optimizer",
            (False, True): "params",
            (True, True): "both",
        }[(self.offload_optimizer, self.offload_params)]


_ALIASES = {
    "micro_batch_size": "mbs",
    "virtual_stages": "v",
    "vpp": "v",
    # megapar-train's and Megatron-LM's names of the same settings
    "sequence_parallel": "sp",
    "cp_comm_type": "cp_comm",
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "virtual_pipeline_model_parallel_size": "v",
}
"""--explain keys (dashes read as underscores) read as another key."""

_PLAN_FLAG_KEYS = {"sp_regather": "--sp-regather"}
"""--explain keys naming a megapar-plan flag that applies to every layout, not a layout's item."""


_SPLIT_KEYS = {
    **dict.fromkeys(("first", "decoder_first_pipeline_num_layers"), FIRST_FLAG),
    **dict.fromkeys(("last", "decoder_last_pipeline_num_layers"), LAST_FLAG),
    **dict.fromkeys(("embedding", "account_for_embedding_in_pipeline_split"), EMBEDDING_FLAG),
    **dict.fromkeys(("loss", "account_for_loss_in_pipeline_split"), LOSS_FLAG),
}
"""--explain keys (dashes read as underscores) that name a pipeline split: megapar-plan's flags
for every layout, --explain's included, not a layout's own item."""


def _split_key_refusal(key: str, value: str) -> str:
    """The one line for a pipeline split given as an --explain item (`first=1`): the
    megapar-plan flag that gives it, beside --explain."""
    flag = _SPLIT_KEYS[key]
    if flag in (FIRST_FLAG, LAST_FLAG):
        given = f"{flag} {value}"
    elif value.lower() in FALSE_WORDS:
        return (
            f"--explain: {key}={value} is not a layout item: the pipeline split is "
            f"megapar-plan's {flag}, off unless given; drop {key}={value}"
        )
    else:
        given = flag
    return (
        f"--explain: {key}={value} is not a layout item: the pipeline split is megapar-plan's "
        f"flag, which --explain's layout takes too; drop it and give {given} beside --explain"
    )


_LABEL_SIZE = re.compile(r"(tp|cp|pp|dp|ep|etp|mbs|v|zero)(\d+)")
_LABEL_FLAGS = {
    "sp": "sp=1",
    "keep": "keep_params=1",
    "rs/micro-batch": "zero3_reduce=micro-batch",
    **{comm: f"cp_comm={comm}" for comm in CP_COMM_TYPES if comm != "auto"},
}


def _from_label(item: str) -> str:
    """One word of a table's layout name (`Candidate.label`: `tp2`, `mbs1`, `1f1b`, `v2`,
    `rc=none`, `sp`, `zero1`, `keep`, `rs/micro-batch`, `a2a`) as its KEY=VALUE item; other words as
    they are."""
    size = _LABEL_SIZE.fullmatch(item)
    if size:
        return f"{size[1]}={size[2]}"
    if item in PLAN_SCHEDULES:
        return f"schedule={item}"
    if item.startswith("rc="):
        return "recompute=" + item[3:]
    return _LABEL_FLAGS.get(item, item)


def parse_candidate(text: str, gpus: int | None = None) -> Candidate:
    """`tp=8,cp=2,pp=16,mbs=1,schedule=interleaved,v=2,recompute=selective,sp=1,zero=1`
    (also `ep=8`, `zero=3,offload=both,keep_params=1,zero3_reduce=micro-batch`; offload one of
    `OFFLOADS`), or the layout's name in the table (`Candidate.label`: `tp8 cp2 pp16 mbs1
    interleaved v2 rc=selective sp zero1`), or a mix of the two; dp defaults to gpus / (tp cp
    pp) (0 where that is not a whole number: no dp fills the GPUs), v to 2 for the V schedules
    (zb-v, dualpipev: two chunks per rank, as megapar-train places them). ValueError naming the
    bad item otherwise."""
    fields = {f.name: f.type for f in dataclasses.fields(Candidate)}
    keys = ", ".join([*fields, "offload"])  # offload=KIND: both offload fields at once
    values: dict = {}
    seen: set[str] = set()
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        item = _from_label(item)
        if "=" not in item:
            raise ValueError(
                f"--explain item {item!r} is not KEY=VALUE (keys: {keys}) nor a word of a "
                f"layout's name in the table (e.g. tp2 pp4 mbs1 1f1b rc=none zero1)"
            )
        key, value = item.split("=", 1)
        given = key.strip()  # as the user wrote it, for the lines below
        key = given.lower().replace("-", "_")
        key = _ALIASES.get(key, key)
        if key in seen:
            raise ValueError(f"--explain: {key} is given twice; give it once")
        seen.add(key)
        if key == "offload":
            if value not in OFFLOADS:
                raise ValueError(f"--explain: offload={value!r}: use one of {', '.join(OFFLOADS)}")
            values["offload_optimizer"] = value in ("optimizer", "both")
            values["offload_params"] = value in ("params", "both")
            continue
        if key in _SPLIT_KEYS:
            raise ValueError(_split_key_refusal(key, value))
        if key in _PLAN_FLAG_KEYS:
            flag = _PLAN_FLAG_KEYS[key]
            raise ValueError(
                f"--explain: {given} is megapar-plan's {flag}, which applies to every layout, not "
                f"a layout's item: give {flag} beside --explain"
            )
        if key not in fields:
            close = difflib.get_close_matches(key, [*fields, "offload", *_ALIASES], n=1)
            hint = f" (did you mean {_ALIASES.get(close[0], close[0])!r}?)" if close else ""
            raise ValueError(
                f"--explain: unknown key {given!r}{hint}; keys: {keys} (or with dashes, or "
                f"megapar-train's name: sequence-parallel, cp-comm-type, ...)"
            )
        if key in ("schedule", "recompute", "zero3_reduce", "cp_comm"):
            allowed = {
                "schedule": PLAN_SCHEDULES,
                "recompute": RECOMPUTE,
                "zero3_reduce": REDUCES,
                "cp_comm": CP_COMMS,
            }[key]
            if value not in allowed:
                known = _explain_schedule(value) if key == "schedule" else ""
                raise ValueError(
                    f"--explain: {key}={value!r}: use one of {', '.join(allowed)}"
                    + (f" ({known})" if known else "")
                )
            values[key] = value
        elif key in ("sp", "keep_params", "offload_optimizer", "offload_params"):
            if value.lower() not in TRUE_WORDS + FALSE_WORDS:
                raise ValueError(
                    f"--explain: {key}={value!r} is not a boolean; give {key}=1 or {key}=0"
                )
            values[key] = value.lower() in TRUE_WORDS
        else:
            try:
                values[key] = int(value)
            except ValueError:
                raise ValueError(f"--explain: {key}={value!r} is not an integer") from None
            if key != "zero" and values[key] < 1:  # a bad value, not a layout that cannot run
                raise ValueError(
                    f"--explain: {key}={values[key]} is invalid: {key} is a size, >= 1; "
                    f"give {key}=1 or more"
                )
    if not seen:
        raise ValueError(
            f"--explain {text!r} names no layout; give its KEY=VALUE items, e.g. "
            f"tp=2,pp=4,mbs=2 (keys: {keys})"
        )
    if "dp" not in values and gpus:
        split = values.get("tp", 1) * values.get("cp", 1) * values.get("pp", 1)
        values["dp"] = 0 if gpus % split else gpus // split  # 0: `check` names the remainder
    if "v" not in values and placement_of(values.get("schedule", "1f1b")) == "v":
        values["v"] = 2
    return Candidate(**values)


def model_refusal(c: Candidate, config) -> str | None:
    """Why the model itself cannot be cut as `c` (heads over tp, layers over pp, ...), or None:
    the part of `check` that no other setting can mend."""
    try:  # in the layout's own keys (tp=3), as --explain takes them
        config.validate(Layout(c.tp, c.pp, c.dp, cp=c.cp), api=True)
    except LayoutError as exc:
        return str(exc)
    return None


def tps_the_gpus_take(c: Candidate, p: Problem) -> str:
    """Beside the model's refusal of `c`'s tp: the tp values both the model and --gpus take at
    `c`'s cp and pp ("" where each one offered fits, or none does); the model offered tp=4 to
    3 GPUs, refused next (megapar-train's note, `tps_the_world_takes`, in the layout's keys)."""
    batch = (p.global_batch, c.mbs)  # (tp=2 at --gpus 8 left a dp of 4, refused for a batch of 6)
    fits = [str(t) for t in tps_taken(p.config, p.gpus, c.pp, c.cp, c.ep, batch)]
    more = ""
    if not fits:  # none at this global batch: those the GPUs take, with the batch they need
        world = tps_taken(p.config, p.gpus, c.pp, c.cp, c.ep)
        fits = [str(t) for t in world]
        needs = [str(n) for n in sorted({c.mbs * (p.gpus // (t * c.pp * c.cp)) for t in world})]
        more = (
            f" (with a --global-batch-size that is a multiple of {or_list(needs)}; "
            f"{p.global_batch} is not)"
            if needs
            else ""
        )
    if not fits:
        return ""
    at = "".join(f", {n}={v}" for n, v in (("cp", c.cp), ("pp", c.pp), ("ep", c.ep)) if v > 1)
    return (
        f"; of those, --gpus {p.gpus}{at} take{'s' if p.gpus == 1 else ''} tp={or_list(fits)}"
        + more
    )


def pps_the_gpus_take(c: Candidate, p: Problem) -> str:
    """Beside the model's refusal of more stages than layers: the pp values both the layers
    and --gpus take at `c`'s tp and cp, with the global batch ("" where each one offered fits,
    or none does): "lower pp to 4 or less" was refused next at --gpus 6."""
    if p.config.num_layers >= c.pp:
        return ""
    batch = (p.global_batch, c.mbs)
    fits = [str(q) for q in pps_taken(p.config.num_layers, p.gpus, c.tp, c.cp, c.ep, batch)]
    if not fits:
        return ""
    at = "".join(f", {n}={v}" for n, v in (("tp", c.tp), ("cp", c.cp), ("ep", c.ep)) if v > 1)
    return f"; of those, --gpus {p.gpus}{at} take pp={or_list(fits[:3])}"


def check(c: Candidate, p: Problem) -> str | None:
    """Why candidate `c` cannot run for problem `p` (its model, GPUs, GPUs per node, global
    batch and sequence length; one sentence naming the fix), or None if it can; for dp 0 (no
    dp fills the GPUs) that, and the model's own reason if it has one."""
    if c.dp == 0:
        grid = _grid_refusal(c, p.gpus, p.gpus_per_node)  # the model's reason reads no dp
        model = model_refusal(dataclasses.replace(c, dp=1), p.config)
        return "; ".join(r for r in (grid, model) if r)
    return (
        _chunks_refusal(c, p.config, p.global_batch)
        or model_refusal(c, p.config)
        or _option_refusal(c, p)
    )


def _option_refusal(c: Candidate, p: Problem) -> str | None:
    """`check` but for `model_refusal`, which reads only (tp, pp, dp, cp): what
    `enumerate_candidates` asks of each option of a grid point the model allows."""
    return (
        _grid_refusal(c, p.gpus, p.gpus_per_node)
        or _schedule_refusal(c, p.config, p.global_batch)
        or _split_refusal(c, p)
        or _sequence_refusal(c, p.seq_len)
        or _cp_comm_refusal(c, p.config)
        or _zero_refusal(c)
        or _expert_refusal(c, p.config)
        or fp8_refusal(p, c.tp)
    )


def _split_refusal(c: Candidate, p: Problem) -> str | None:
    """Why the candidate's stages or model chunks cannot take `p.pipeline_split` (megapar-train's
    own rule, `split_counts`), or None."""
    split = p.pipeline_split
    if split.even:
        return None
    try:
        split.check(c.pp)
        chunks = f"--pp {c.pp} x {c.v} = {c.pp * c.v} model chunks"
        what = f"--pp {c.pp} stages" if c.v == 1 else chunks
        n = p.config.num_layers
        split_layers(n, c.pp * c.v, split, what, c.v, placement_of(c.schedule))
    except LayoutError as exc:
        return str(exc)
    return None


def _expert_refusal(c: Candidate, config) -> str | None:
    """Why the candidate's ep or etp cannot run (megapar-train's own rules:
    `training.model_config`), or None."""
    if c.etp not in (1, c.tp):
        fix = "etp=1" if c.tp == 1 else f"etp=1 or etp={c.tp}"
        return f"etp {c.etp} must be 1 or the layout's tp ({c.tp}): use {fix}"
    if c.etp > 1:
        size = getattr(config, "expert_size", 0) if getattr(config, "num_moe_layers", 0) else 0
        if not size:
            return f"etp {c.etp} needs a mixture-of-experts model (this one has no routed experts)"
        if size % c.etp:
            return f"etp {c.etp} does not divide the experts' intermediate size {size}; use etp=1"
    if c.ep == 1:
        return None
    if c.ep < 1:
        return f"ep {c.ep} is invalid: it is the ranks the experts are sharded over, >= 1"
    experts = getattr(config, "num_local_experts", 0) if getattr(config, "num_moe_layers", 0) else 0
    if not experts:
        return f"ep {c.ep} needs a mixture-of-experts model (this one has no routed experts)"
    ranks = c.dp * c.cp
    sizes = [e for e in range(1, ranks + 1) if ranks % e == 0 and experts % e == 0]
    fix = (
        f"use ep={', '.join(map(str, sizes[:-1]))} or {sizes[-1]}" if len(sizes) > 1 else "use ep=1"
    ) + f" (each divides dp x cp = {ranks} and the {experts} experts)"
    if ranks % c.ep:
        return (
            f"ep {c.ep} does not divide dp x cp = {ranks}: experts are sharded over dp x cp "
            f"ranks; {fix}"
        )
    if experts % c.ep:
        return f"ep {c.ep} does not divide the {experts} experts; {fix}"
    return None


def ep_sizes(config, dp: int, zero: int) -> tuple[int, ...]:
    """The ep sizes a plan tries for `dp` ranks (dp x cp: ep folds into both): for a
    mixture-of-experts model every divisor of them that divides its routed experts (at any ZeRO
    stage: under ZeRO-3 the experts' units are sharded over the expert-data-parallel group); 1
    otherwise."""
    experts = getattr(config, "num_local_experts", 0) if getattr(config, "num_moe_layers", 0) else 0
    if not experts:
        return (1,)
    return tuple(d for d in divisors(dp) if experts % d == 0)


def etp_sizes(config, tp: int) -> tuple[int, ...]:
    """The expert tensor-parallel sizes a plan tries at `tp`: 1 (each routed expert whole on
    every tp rank) and, for a mixture-of-experts model at tp > 1 whose experts' intermediate
    size tp divides, tp (each split over the tp ranks)."""
    size = getattr(config, "expert_size", 0) if getattr(config, "num_moe_layers", 0) else 0
    return (1, tp) if tp > 1 and size and size % tp == 0 else (1,)


def cp_comms(config, tp: int, cp: int) -> tuple[str, ...]:
    """The cp attentions a plan tries at (`tp`, `cp`): none at cp 1 ("auto"); else the model's
    own (auto: the ring, or the all-gather for grouped-query heads), the ring (p2p) too for
    grouped-query heads (it holds two K/V blocks where the all-gather holds cp of them, and
    hides its sends behind the attention), and the all-to-all (a2a) where a tp rank's query
    heads divide over cp."""
    if cp == 1:
        return ("auto",)
    q_heads = heads(config)
    ring = ("p2p",) if method_for(q_heads, getattr(config, "kv_heads", q_heads)) != "ring" else ()
    a2a = ("a2a",) if heads_error(q_heads // tp, cp) is None else ()
    return ("auto", *ring, *a2a)


def _grid_refusal(c: Candidate, gpus: int, gpus_per_node: int) -> str | None:
    """Why the candidate's tp x cp x pp x dp grid does not fit the cluster, or None."""
    if c.tp * c.cp * c.pp * c.dp != gpus:
        names, sizes = (
            ("tp*cp*pp", f"{c.tp}*{c.cp}*{c.pp}") if c.cp > 1 else ("tp*pp", f"{c.tp}*{c.pp}")
        )
        split = c.tp * c.cp * c.pp
        if c.dp == 0:
            return (
                f"--gpus {gpus} is not a multiple of {names} = {sizes} = {split}, so no dp fills "
                f"them; choose sizes whose product divides {gpus}"
            )
        why = (
            f": {names} = {split} does not divide {gpus}, so no dp fills it" if gpus % split else ""
        )
        fix = (
            f"; give dp={gpus // split}, or leave dp out (it is --gpus / ({names}))"
            if gpus % split == 0
            else f"; choose sizes whose product divides {gpus}"
        )
        return f"{names}*dp = {sizes}*{c.dp} = {split * c.dp} is not --gpus {gpus}{why}{fix}"
    if tp_spans_nodes(c.tp, gpus, gpus_per_node):
        return _spans_nodes(c.tp, gpus_per_node)
    return None


def _explain_schedule(value: str) -> str:
    """megapar's name for a schedule another tool or paper names (`ScheduleInterleaved1F1B`,
    `ZB-H1`) in --explain's terms ("'ZB-H1' is megapar's schedule=zb-h1"); "" for a name
    `schedule_named_elsewhere` does not know."""
    said = schedule_named_elsewhere(value)
    said = re.sub(r"--schedule ([\w-]+)", r"schedule=\1", said)
    return said.replace(" --virtual-stages V", ",v=V")


def _chunks_refusal(c: Candidate, config, global_batch: int) -> str | None:
    """Why a schedule of several model chunks per rank (interleaved's v, at least 2; the V's
    two) cannot cut the model's layers into pp of them, with the fix that can: for interleaved
    a smaller v at this pp, else a pp the world takes (one dividing pp x dp, dp taking the
    rest, and its micro-batches the `global_batch`: "lower pp to 6" was refused next at --gpus
    8), or a schedule of one chunk per rank; None otherwise. Before the model's own count of
    stages (`check`): its "lower pp to 4" was refused next at pp=4 for a V's 8 chunks, and
    before interleaved's v >= 2 (which then refused the pp it had taken)."""
    interleaved = c.schedule == "interleaved"
    chunks = max(c.v, 2) if interleaved else 2
    if c.schedule not in CHUNKED_SCHEDULES or config.num_layers >= c.pp * chunks:
        return None
    what = (
        f"pp*v = {c.pp}*{c.v}" if interleaved and c.v >= 2 else f"2*pp = 2*{c.pp}"
    ) + f" = {c.pp * chunks}"
    why = "; interleaved 1F1B needs v >= 2" if interleaved and c.v < 2 else ""
    v_fits = config.num_layers // c.pp
    top = min(config.num_layers // 2, c.pp - 1)
    pps = [
        str(p)
        for p in range(top, 1, -1)
        if (c.pp * c.dp) % p == 0 and global_batch % (c.mbs * c.pp * c.dp // p) == 0
    ][:3]
    if interleaved and v_fits >= 2:
        fix = f"lower v to {v_fits}" + (f" (or pp to {or_list(pps)} with v=2)" if pps else "")
    elif pps:
        fix = f"lower pp to {or_list(pps)}" + (" with v=2" if interleaved and c.v != 2 else "")
    elif config.num_layers >= c.pp:
        fix = "use a schedule of one chunk per rank (schedule=1f1b or zb-h1)"
    else:  # (one chunk per rank was offered at pp=6 for 4 layers, refused next)
        batch = (global_batch, c.mbs)
        ones = pps_taken(config.num_layers, c.pp * c.dp, 1, 1, 1, batch)
        ones = [q for q in ones if q > 1] or [q for q in range(config.num_layers, 1, -1)]
        fix = (
            f"lower pp to {or_list([str(q) for q in ones[:3]])} with a schedule of one chunk "
            f"per rank (schedule=1f1b or zb-h1)"
        )
    return (
        f"{config.num_layers} layers cannot be cut into {what} model chunks (each needs at "
        f"least one layer{why}); {fix}"
    )


def _schedule_refusal(c: Candidate, config, global_batch: int) -> str | None:
    """Why the candidate's schedule, recompute, micro-batch size or model chunks cannot run, or
    None."""
    if c.schedule not in PLAN_SCHEDULES:
        return f"unknown schedule {c.schedule!r}; the planner models {', '.join(PLAN_SCHEDULES)}"
    if c.recompute not in RECOMPUTE:
        return f"unknown recompute {c.recompute!r}; use {', '.join(RECOMPUTE)}"
    if c.mbs < 1:
        return f"micro-batch size {c.mbs} is invalid: it is sequences per micro-batch, >= 1"
    if global_batch % (c.mbs * c.dp):
        per_dp = global_batch // c.dp if global_batch % c.dp == 0 else 0
        fix = (
            f"; give mbs= a divisor of the {per_dp} sequences each dp rank takes, or a "
            f"--global-batch-size that is a multiple of {c.mbs * c.dp}"
            if per_dp
            else f"; give a --global-batch-size that is a multiple of {c.mbs * c.dp}"
        )
        return (
            f"global batch {global_batch} is not divisible by micro-batch size {c.mbs} x dp "
            f"{c.dp}{fix}"
        )
    m = global_batch // (c.mbs * c.dp)
    if c.pp == 1 and c.schedule != "1f1b":
        return f"schedule {c.schedule} needs pp > 1 (with one stage there is no pipeline)"
    if c.schedule == "interleaved":
        if refusal := _chunks_refusal(c, config, global_batch):
            return refusal
        if c.v < 2:
            return "interleaved 1F1B needs v >= 2 model chunks per rank"
        try:  # megapar-train's own rule (m divisible by max(1, m // pp))
            interleaved_rounds(c.pp, m)
        except ValueError as exc:
            return str(exc)
    elif c.schedule in ("zb-v", "dualpipev"):
        if c.v != 2:
            return (
                f"schedule {c.schedule} places exactly v = 2 model chunks per rank (a V); "
                f"leave v out or give v=2"
            )
        if refusal := _chunks_refusal(c, config, global_batch):
            return refusal
        if c.schedule == "dualpipev" and m < 2 * c.pp:
            return f"DualPipeV needs at least 2*pp = {2 * c.pp} micro-batches, got m = {m}"
    elif c.v != 1:
        takers = schedules_taking(c.v)
        return (
            f"v {c.v} needs schedule {or_list(takers)}; schedule {c.schedule} runs one model "
            f"chunk per rank: {'give it' if len(takers) == 1 else 'give one of them'}, or "
            f"leave v out"
        )
    return None


def _sequence_refusal(c: Candidate, seq_len: int | None) -> str | None:
    """Why sequence or context parallelism cannot split the candidate's sequence, or None."""
    if c.sp and c.tp == 1:
        return "sequence parallelism needs tp > 1"
    if c.sp and seq_len and seq_len % c.tp:
        return f"sequence parallelism needs --seq-len {seq_len} divisible by tp {c.tp}"
    if c.cp > 1 and seq_len:
        try:
            check_cp_seq_len(seq_len, Layout(c.tp, c.pp, c.dp, cp=c.cp), c.sp)
        except ValueError as exc:
            return str(exc)
    return None


def _cp_comm_refusal(c: Candidate, config) -> str | None:
    """Why the candidate's context-parallel attention cannot run (megapar-train's rules:
    `check_cp_comm`, and a --cp-comm-type other than auto needs cp > 1), or None."""
    if c.cp_comm not in CP_COMMS:
        return f"cp_comm={c.cp_comm}: use one of {', '.join(CP_COMMS)}"
    if c.cp_comm == "auto":
        return None
    if c.cp == 1:
        return f"cp_comm={c.cp_comm} chooses cp attention's exchange, and cp 1 has none: use cp > 1"
    if c.cp_comm == "a2a":
        per_tp = heads(config) // c.tp
        why = heads_error(per_tp, c.cp)
        if why:
            return (
                f"{why} ({heads(config)} heads / tp {c.tp}); use cp_comm=p2p, or a cp "
                f"dividing {per_tp}"
            )
    return None


def _zero_refusal(c: Candidate) -> str | None:
    """Why the candidate's ZeRO stage or offload settings cannot run, or None."""
    if c.zero not in ZERO_STAGES:
        return f"zero {c.zero}: the planner models ZeRO stages {', '.join(map(str, ZERO_STAGES))}"
    if c.zero and c.dp * c.cp == 1:
        return f"ZeRO-{c.zero} needs dp > 1 (or cp > 1: there is nothing to shard over)"
    if c.offload_params and c.zero != 3:
        return "offload of the parameters needs zero 3 (it moves the parameter shards)"
    if c.offload_params and not c.offload_optimizer:
        return (
            "offload of the parameters needs the optimizer's too (offload=both: "
            "megapar-train's --offload-params steps the host shards with --offload-optimizer)"
        )
    if c.zero3_reduce not in REDUCES:
        return f"zero3_reduce={c.zero3_reduce}: use one of {', '.join(REDUCES)}"
    if c.zero3_reduce != "step" and c.zero != 3:
        return "zero3_reduce needs zero 3 (ZeRO-2 reduces every micro-batch already)"
    if c.keep_params and c.zero != 3:
        return (
            "keep_params needs zero 3 (it keeps a stage's gathered parameters over the "
            "step, as megapar-train's --zero3-keep-params)"
        )
    return None


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (trial division up to sqrt(n): 1e9 takes milliseconds)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _spans_nodes(tp: int, gpus_per_node: int) -> str:
    """The refusal of a tp whose groups span nodes (`mesh.tp_spans_nodes`)."""
    return (
        f"tp {tp} would span nodes (--gpus-per-node {gpus_per_node}); tensor parallelism needs "
        f"the intra-node link"
    )


def _grid_reason(
    config, tp: int, pp: int, dp: int, gpus: int, gpus_per_node: int, global_batch: int
) -> str | None:
    """Why no option (micro-batch size, schedule, recompute, SP, ZeRO) can run tp x pp x dp
    (x cp) on `gpus`."""
    try:
        config.validate(Layout(tp, pp, dp), api=True)
    except LayoutError as exc:
        return str(exc)
    if tp_spans_nodes(tp, gpus, gpus_per_node):
        return _spans_nodes(tp, gpus_per_node)
    if global_batch % dp:
        return f"global batch {global_batch} is not divisible by dp {dp}"
    return None


def default_cp_sizes(seq_len: int | None) -> tuple[int, ...]:
    """Context-parallel sizes a plan tries unless told: 1, and 2, 4, 8 too from 8192 tokens on
    (where a sequence's activations outgrow tp and recomputation)."""
    return (1, 2, 4, 8) if seq_len and seq_len >= 8192 else (1,)


def enumerate_candidates(
    p: Problem,
    micro_batch_sizes=(1, 2, 4, 8),
    schedules=PLAN_SCHEDULES,
    virtual_stages=(2, 4),
    recompute=RECOMPUTE,
    allow_sp: bool = True,
    allow_zero: bool = True,
    cp_sizes=None,
    zero_stages=ZERO_STAGES,
    offloads=("none",),
    etp=None,
    cp_comm=None,
):
    """(valid candidates, [(candidate, reason)] rejected) for problem `p` (its model, GPUs,
    GPUs per node, global batch and sequence length) over the whole space (`cp_sizes`:
    None for `default_cp_sizes`; `zero_stages` tried where dp x cp > 1, each with the
    `offloads` it can take and, for ZeRO-3 with pp, with and without kept parameters; `etp`:
    the expert tensor-parallel size, None for `etp_sizes`; `cp_comm`: the cp attention at
    cp > 1, None for `cp_comms`). A
    (tp, pp, dp) grid that no option can run (too many heads or stages, tp across nodes, a batch dp
    does not divide) is rejected once, as its plain candidate, so the search is quick even for huge
    GPU counts with many divisors."""
    valid, rejected = [], []
    config, gpus = p.config, p.gpus
    for tp in divisors(gpus):
        for cp in (c for c in cp_sizes or default_cp_sizes(p.seq_len) if (gpus // tp) % c == 0):
            for pp in divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                reason = _grid_reason(config, tp, pp, dp, gpus, p.gpus_per_node, p.global_batch)
                if reason:
                    rejected.append((Candidate(tp, pp, dp, cp=cp), reason))
                    continue
                if etp is not None and etp not in (1, tp):  # a fixed etp this tp cannot take
                    plain = Candidate(tp, pp, dp, cp=cp, etp=etp)
                    rejected.append((plain, _expert_refusal(plain, config) or ""))
                    continue
                model = model_refusal(Candidate(tp, pp, dp, cp=cp), config)  # every option's
                etps = (etp,) if etp is not None else etp_sizes(config, tp)
                comms = (cp_comm,) if cp_comm is not None and cp > 1 else cp_comms(config, tp, cp)
                eps = ep_sizes(config, dp * cp, 0)  # the same at every ZeRO stage
                for mbs, schedule, v, rc, sp, zero, off, keep, ep in _options(
                    pp,
                    dp * cp,
                    tp > 1 and allow_sp,
                    zero_stages if allow_zero else (0,),
                    micro_batch_sizes,
                    schedules,
                    virtual_stages,
                    recompute,
                    offloads,
                    lambda zero, eps=eps: eps,
                ):
                    for e, comm in ((e, comm) for e in etps for comm in comms):
                        c = Candidate(
                            tp,
                            pp,
                            dp,
                            mbs,
                            schedule,
                            v,
                            rc,
                            sp,
                            zero,
                            cp,
                            off in ("optimizer", "both"),
                            off in ("params", "both"),
                            keep,
                            ep=ep,
                            etp=e,
                            cp_comm=comm,
                        )
                        reason = model or _option_refusal(c, p)
                        if reason:
                            rejected.append((c, reason))
                        else:
                            valid.append(c)
    return valid, rejected


def chunk_counts(schedule: str, virtual_stages) -> tuple[int, ...]:
    """The model chunks per rank a plan tries for `schedule`: each of `virtual_stages` for the
    interleaved one, 2 for the V schedules (zb-v, dualpipev), 1 for the others."""
    if schedule == "interleaved":
        return tuple(virtual_stages)
    return (2,) if placement_of(schedule) == "v" else (1,)


def _options(
    pp,
    replicas,
    sp,
    zero_stages,
    micro_batch_sizes,
    schedules,
    virtual_stages,
    recompute,
    offloads=("none",),
    eps=lambda zero: (1,),
):
    """(mbs, schedule, v, recompute, sp, zero, offload, keep_params, ep) choices of a (tp, cp,
    pp, dp) layout (`eps(zero)`: the ep sizes tried with that ZeRO stage)."""
    for mbs in micro_batch_sizes:
        for schedule in schedules if pp > 1 else ("1f1b",):
            for v in chunk_counts(schedule, virtual_stages):
                for rc in recompute:
                    for with_sp in (False, True) if sp else (False,):
                        for zero in (z for z in zero_stages if z == 0 or replicas > 1):
                            for off in (
                                o
                                for o in offloads
                                if o == "none" or (zero == 3 or o == "optimizer")
                            ):
                                for keep in (False, True) if zero == 3 and pp > 1 else (False,):
                                    for ep in eps(zero):
                                        yield mbs, schedule, v, rc, with_sp, zero, off, keep, ep
