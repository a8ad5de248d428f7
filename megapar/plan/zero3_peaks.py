"""ZeRO-3's gathered units and full gradient buffers over a step, as `ShardedParams` holds
them: their peaks (what `plan.state.RankState` counts and the dry run measures) and what is
alive at the two moments `plan.process` takes a process's peak at (the top of the backward and
its end), which are never the same moment as both peaks.

A unit's bytes are its full padded buffer (a float8 unit's gathered buffer: 1 byte an element);
a led unit (`UnitSpec.led`: under expert parallelism an experts' unit, under ZeRO-3's float8
all-gather a block's float8 weights) is gathered, freed and given its gradient buffer with its
lead (the unit before it that is not led) and reduced just before it. An experts' unit whose
group is one rank (ep = cp x dp) is kept whole (`Unit.resident`): the callers count 0 bytes of
gathered buffer and of gradient buffer for it (its parameters and gradient are its shards,
`RankState.weights` / `grads`; under --offload-params it is still copied in from the host, so
gathered), and its launch reduces nothing (`alone`).
"""

from __future__ import annotations

from itertools import pairwise

from megapar.data_parallel.sharded_params import ShardedParams
from megapar.plan.params import UnitSpec


def gathered_peak(
    specs: list[UnitSpec], nbytes: list[int], keep: bool, sent: list[int] | None = None
) -> int:
    """Bytes of ZeRO-3's units gathered at once at the peak, as `ShardedParams`' hooks hold
    them (`nbytes`: each unit's full padded buffer; an experts' unit counted with its lead,
    `UnitSpec.led`), with the shards of the gathers in flight (`sent`: each unit's, the
    16-bit or float8 slice a cast unit's gather sends or, under --offload-params, the device
    staging shard an offloaded unit's gather sends, made at its launch and freed when it is
    waited for; 0 for the others; default none). Without `keep`: the persistent unit (kept
    over the step) with, at the worst chunk, the largest of the moments its hooks hold most:
    the chunk's forward start (its roots, the first block's gather in flight), a block's
    forward (the roots, the block, the next one's gather in flight), a block's backward (the
    block and the one before it in flight: the tail was freed when the head's backward
    ended, the embedding unit after the forward) and the backward's start (the tail with the
    last block in flight); the embedding unit is prefetched, uncast, after the block after the
    first is freed. With `keep` every unit stays gathered: the peak is at the last gather's
    launch, every unit held but the chunks' after it, its shard in flight."""
    sent = [0] * len(nbytes) if sent is None else sent
    leads, sizes = _with_experts(specs, nbytes)
    _, shards = _with_experts(specs, sent)
    persistent = sum(n for u, n in zip(leads, sizes) if u.kind == "persistent")
    chunks = sorted({u.chunk for u in leads if u.kind != "persistent"})
    if keep:
        held = peak = persistent
        for ci in chunks:  # forwards in chunk order: roots gathered, then each block launched
            held += sum(n for u, n in zip(leads, sizes) if u.chunk == ci and u.kind != "block")
            peak = max(peak, held)
            for u, n, s in zip(leads, sizes, shards):
                if u.chunk == ci and u.kind == "block":
                    held += n
                    peak = max(peak, held + s)
        return peak
    worst = 0
    for ci in chunks:
        own = [(u, n, s) for u, n, s in zip(leads, sizes, shards) if u.chunk == ci]
        roots = sum(n for u, n, _ in own if u.kind != "block")
        tail = sum(n for u, n, _ in own if u.kind == "root")
        blocks = [(n, s) for u, n, s in own if u.kind == "block"]
        moments = [roots]
        if blocks:
            (first, s_first), (last, s_last) = blocks[0], blocks[-1]
            moments += [roots + first + s_first, tail + last + s_last]
        for (a, s_a), (b, s_b) in pairwise(blocks):
            moments += [roots + a + b + s_b, a + b + s_a]
        worst = max(worst, *moments)
    return persistent + worst


def led_by(specs: list[UnitSpec]) -> dict[int, list[int]]:
    """{index of a leading unit: it and the units it leads, in `specs`' order}: each led unit
    (`UnitSpec.led`) follows its lead; they are gathered, freed and given gradient buffers
    together, and reduced led units first, in reverse (`ShardedParams.units`)."""
    out: dict[int, list[int]] = {}
    lead = -1
    for i, u in enumerate(specs):
        if u.led:
            out[lead].append(i)
        else:
            lead = i
            out[i] = [i]
    return out


def _with_experts(specs: list[UnitSpec], nbytes: list[int]) -> tuple[list[UnitSpec], list[int]]:
    """The leading units, each with the bytes of the units it leads added (they are gathered
    and freed together)."""
    leads: list[UnitSpec] = []
    sizes: list[int] = []
    for u, n in zip(specs, nbytes):
        if u.led:
            sizes[-1] += n
        else:
            leads.append(u)
            sizes.append(n)
    return leads, sizes


def grad_buffers_peak(
    specs: list[UnitSpec],
    nbytes: list[int],
    deferred: set[int],
    *,
    whole: bool,
    kept: bool = False,
    alone: frozenset[int] = frozenset(),
) -> int:
    """Bytes of ZeRO-3's full gradient buffers alive at once at the peak, as `ShardedParams`
    holds them (`nbytes`: each unit's full padded buffer; `deferred`: the units holding the
    tied embedding over pipeline stages, reduced in finish()). With `whole` every unit's.
    Else (one micro-batch of one chunk): the root units' (and then the persistent unit's)
    buffers are made when the chunk's backward starts, each block's when its backward
    gathers it and the embedding unit's after the first block (before the launch of the
    embedding unit, or of a persistent unit holding embedding parameters); the units launch in
    `ShardedParams.units`' order (blocks from the last, the embedding, the root, the
    persistent unit; the deferred ones at the end; the units a unit leads just before it, their
    buffers made with its), and each launch first waits for the reductions in flight
    beyond `ShardedParams.MAX_REDUCES_IN_FLIGHT - 1`, dropping their buffers. The peak is
    taken at each launch (before that wait) and at the backward's end. `kept` (a later
    micro-batch of the step): the deferred units' buffers alive from the start. `alone`: the
    units whose group is one rank (no buffer, 0 in `nbytes`; their launch neither waits for
    the reductions in flight nor adds one)."""
    if whole:
        return sum(nbytes)
    at_launch, end = _buffer_walk(specs, nbytes, deferred, kept, alone)
    return max([end, *at_launch.values()])


def _buffer_walk(
    specs: list[UnitSpec],
    nbytes: list[int],
    deferred: set[int],
    kept: bool,
    alone: frozenset[int],
) -> tuple[dict[int, int], int]:
    """`grad_buffers_peak`'s walk (one micro-batch, not `whole`): ({unit: the buffers' bytes
    alive at its launch, before its wait}, the bytes alive at the backward's end)."""
    members = {i: [*reversed(js[1:]), i] for i, js in led_by(specs).items()}  # reduce order
    order = []
    for ci in sorted({u.chunk for u in specs if u.chunk >= 0}, reverse=True):
        idx = [i for i in members if specs[i].chunk == ci]
        order += [i for i in reversed(idx) if specs[i].kind == "block"] + [
            i for kind in ("embedding", "root") for i in idx if specs[i].kind == kind
        ]
    order += [i for i in members if specs[i].kind == "persistent"]
    order = [i for i in order if i not in deferred] + [i for i in order if i in deferred]
    order = [j for i in order for j in members[i]]
    lead = {j: i for i, js in members.items() for j in js}
    roots = [j for i in members if specs[i].kind == "root" for j in members[i]]
    persistent = [j for i in members if specs[i].kind == "persistent" for j in members[i]]
    alive = (
        set(roots)
        | (set(persistent) if roots or any(u.kind == "embedding" for u in specs) else set())
        | (deferred if kept else set())
    )
    embeddings = {j for i in members if specs[i].kind == "embedding" for j in members[i]}
    at_launch: dict[int, int] = {}
    flight: list[int] = []  # the units whose gradients are being reduced
    for i in order:
        if lead[i] in deferred:
            break
        if specs[lead[i]].kind == "embedding" or specs[lead[i]].embedding_grads:
            alive |= embeddings  # made once the backward is past the first block
        alive.update(members[lead[i]] if i == members[lead[i]][0] else [i])
        at_launch[i] = sum(nbytes[j] for j in alive)
        if i in alone:
            continue
        while len(flight) >= ShardedParams.MAX_REDUCES_IN_FLIGHT:
            alive.discard(flight.pop(0))
        flight.append(i)
    alive |= {j for i in deferred for j in members.get(i, [i])} | embeddings
    return at_launch, sum(nbytes[j] for j in alive)


def in_backward(
    specs: list[UnitSpec],
    nbytes: list[int],
    deferred: set[int],
    *,
    whole: bool,
    keep: bool,
    kept: bool = False,
    grads: list[int] | None = None,
    sent: list[int] | None = None,
    alone: frozenset[int] = frozenset(),
) -> tuple[int, int, int, int]:
    """The third moment `plan.process` takes a ZeRO-3 process's peak at, inside the backward:
    as a block of the stage's last chunk is reduced (its launch, before the wait), the block
    and the one before it (prefetched, its gather's shard in flight: `sent`) and the
    persistent unit gathered, and the gradient buffers alive then (`grad_buffers_peak`'s walk:
    the roots', the block's and those still being reduced; every unit's with `whole`). Of the
    chunk's blocks, from the last, the first where the units and buffers together are most:
    (gathered bytes, gradient buffers' bytes, the reduced block's gradient buffer's bytes
    (and its led units'), how many of the chunk's blocks finished their backward before it).
    (0, 0, 0, 0) where the chunk has no block. With `keep` every unit stays gathered.
    `grads`: each unit's gradient buffer's bytes (default `nbytes`); `alone`: the units whose
    group is one rank (`grad_buffers_peak`)."""
    members = led_by(specs)
    lead = list(members)
    grads = nbytes if grads is None else grads
    sent = [0] * len(nbytes) if sent is None else sent

    def held(units, sizes) -> int:  # a lead with its led units; a led unit (deferred) alone
        return sum(sizes[j] for j in {j for i in units for j in members.get(i, [i])})

    last = max((specs[i].chunk for i in lead), default=-1)
    blocks = [i for i in lead if specs[i].chunk == last and specs[i].kind == "block"]
    persistent = [i for i in lead if specs[i].kind == "persistent"]
    if not blocks:
        return 0, 0, 0, 0
    at_launch = {} if whole else _buffer_walk(specs, grads, deferred, kept, alone)[0]
    best = (0, 0, 0, 0)
    for done, b in enumerate(reversed(blocks)):
        k = blocks.index(b)
        before = blocks[k - 1 : k] if k else []
        gathered = (
            sum(nbytes) if keep else held(persistent + [b] + before, nbytes) + held(before, sent)
        )
        buffers = sum(grads) if whole else at_launch.get(members[b][0], 0)
        if gathered + buffers > best[0] + best[1]:
            best = (gathered, buffers, held([b], grads), done)
    return best


def phases(
    specs: list[UnitSpec],
    nbytes: list[int],
    deferred: set[int],
    *,
    whole: bool,
    keep: bool,
    kept: bool = False,
    grads: list[int] | None = None,
    sent: list[int] | None = None,
) -> tuple[int, int, int]:
    """(gathered bytes at the top of the backward, gathered bytes at its end, full gradient
    buffers' bytes at its top), as `ShardedParams` holds them. The top is the chunk's backward
    start, where the most activations are alive: the stage's last chunk's tail units (kept
    gathered since the forward; its whole root where it is not split) with its last block
    prefetched, the persistent unit; the roots' and the persistent unit's gradient buffers
    made (every unit's with `whole`; the deferred units' too with `kept`, a later
    micro-batch). The end: the worst chunk's embedding unit (gathered for the embedding's
    backward; a chunk without one, its roots) and the persistent unit. With `keep` every
    unit stays gathered. `grads`: each unit's gradient buffer's bytes (default `nbytes`);
    `sent`: each unit's cast or staging shard (`gathered_peak`), the last block's in flight at
    the top."""
    members = led_by(specs)
    lead = list(members)
    kinds = {i: specs[i].kind for i in lead}

    def held(units, sizes=nbytes) -> int:  # a lead with its led units; a led unit alone
        return sum(sizes[j] for j in {j for i in units for j in members.get(i, [i])})

    persistent = [i for i in lead if kinds[i] == "persistent"]
    last = max((specs[i].chunk for i in lead), default=-1)
    chunk = [i for i in lead if specs[i].chunk == last]
    blocks = [i for i in chunk if kinds[i] == "block"]
    roots = [i for i in lead if kinds[i] == "root"]
    top = held(persistent + [i for i in chunk if kinds[i] == "root"] + blocks[-1:])
    top += held(blocks[-1:], sent) if sent is not None else 0  # its gather in flight
    end = 0
    for ci in {specs[i].chunk for i in lead if kinds[i] != "persistent"}:
        own = [i for i in lead if specs[i].chunk == ci]
        embedding = [i for i in own if kinds[i] == "embedding"]
        end = max(end, held(embedding or [i for i in own if kinds[i] == "root"]))
    end += held(persistent)
    if keep:
        top = end = sum(nbytes)
    grads = nbytes if grads is None else grads
    if whole:
        return top, end, sum(grads)
    made = set(roots) | (set(persistent) if roots or "embedding" in kinds.values() else set())
    if kept:
        made |= deferred
    return top, end, held(made, grads)
