"""A megapar-train run and the tools built on the same engine: the flags and every check
made before a worker starts (`config`, the `validate_*` modules), the run's plan (`run_plan`,
`data`), the engine that builds a rank's state and runs its steps (`engine`, `step`), the loop
(`loop`), its logging, checkpoints and export; `megapar.prepare` (`prepare`); megapar-eval's,
megapar-generate's and megapar-bubble's runs (`inference`, `generate`, `bubble`); other tools'
flags and configs read as megapar-train's (`other_tools`, `deepspeed_config`,
`torchtitan_config`, `hf_trainer_config`). docs/architecture.md lists every module.
"""
