"""Checkpoints: the sharded format and its manifest, saving in the background (`async_save`)
under a lock (`lock`), publishing a step, conversion between layouts, Hugging Face import and
export, and other tools' checkpoints: torchtitan's DCP (`dcp`) and Megatron-LM's (`megatron`).
"""
