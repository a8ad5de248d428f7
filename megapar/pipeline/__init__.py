"""Pipeline parallelism: schedules as data, a process-free simulator, and timeline analysis.

- `megapar.pipeline.schedules`: per-stage instruction lists (GPipe, 1F1B, interleaved 1F1B, ZB-H1)
  over a small action vocabulary; `placement` maps model chunks to virtual stages.
- `megapar.pipeline.simulate`: runs every stage's schedule together on a cost model (no processes).
- `megapar.pipeline.timeline`: events, bubble statistics, Chrome traces and Gantt plots, shared by
  the simulator and the real executor's tracer.

Nothing torch-heavy is imported here; import the submodules directly.
"""
