"""Pipeline parallelism: the model cut into stages, schedules as data, and the runtime that
runs them.

- `partition`: cutting a model into stages and building this rank's stage; `placement`: which
  chunks a rank holds (round-robin or in a V); `tied`: the tied embedding kept equal on the
  first and last stage.
- `schedules`: per-stage instruction lists (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V,
  DualPipeV) over the vocabulary of `actions`; `messages`: when a stage issues each message.
- `step_plan`, `executor`, `step_inputs`, `backward`, `p2p`: one stage's step planned once per
  step size, then run (computes, B / W backward halves, messages batched in named pairs).
- `simulate`: every stage's schedule run together on a cost model (no processes); `timeline`
  and `trace`: events, bubble statistics, Chrome traces and Gantt plots, shared by the
  simulator and the real executor's tracer.
- `nccl_rules`, `certify`, `certify_real`: the message programs checked against NCCL's
  point-to-point rules, without processes and on real ones.

Nothing torch-heavy is imported here; import the submodules directly.
"""
