"""Failure handling, in one place.

- `stop`: what stops a run on purpose: non-finite losses or gradients (`NonFiniteGuard`), stop
  signals, wall-clock and step budgets (`StopRequests`), agreed on by every rank;
- `status`: what each rank is doing now (its step and action, in a buffer the launcher reads)
  and every rank's Python stacks when a run fails;
- `blame`: which rank caused a failure of local workers, and which failed because of it;
- `progress`: under torchrun / srun, each rank's step and action in the job's store, and the
  rank holding the others up named from them when a wait times out;
- `report`: a worker's failure as one line for the terminal, its traceback in a per-rank log;
- `processes`: whether a process is alive (lock owners, crashed saves, dead launchers), and
  workers that die with their launcher;
- `slow`: `--inject-slow`, one rank's forwards slowed (a testing tool for the straggler
  report and the timeouts).

The launcher (`megapar.launcher`) starts workers and brings them all down when one fails, using
these; the pipeline and the training step report their actions to `status`.
"""
