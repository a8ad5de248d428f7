"""Pipeline parallelism: schedules as data, a process-free simulator, and timeline analysis.

- `megapar.pipeline.schedules`: per-stage instruction lists (GPipe, 1F1B) over a small action vocabulary.
- `megapar.pipeline.simulate`: runs every stage's schedule together on a cost model (no processes).
- `megapar.pipeline.timeline`: events, bubble statistics, Chrome traces and Gantt plots, shared by
  the simulator and the real executor's tracer.

Nothing torch-heavy is imported here; import the submodules directly.
"""
