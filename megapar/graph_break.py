"""`graph_break`: the mark on a function that torch.compile'd code calls eagerly (a graph break
made on purpose: a tp collective, the zero-bubble deferring linear, context parallelism's
exchanges, a MoE layer's routed experts).

It is `torch.compiler.disable` in the lazy form torch marks its own functions with
(`torch._disable_dynamo`): the same graph break, but torch._dynamo is imported at the marked
function's first call, not when the module is imported. Marked functions are called only
inside compiled code, so only `--compile` pays for dynamo's imports (their cost:
docs/testing.md).
"""

from __future__ import annotations

import torch

graph_break = torch._disable_dynamo
