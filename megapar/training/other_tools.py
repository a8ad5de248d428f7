"""Other tools' names for megapar-train's flags: Megatron-LM's, torchtitan's, DeepSpeed's and the
Hugging Face Trainer's flags, each answered with megapar's flag or a sentence saying what
megapar does instead, and the defaults a Megatron-LM command line does not share with
megapar-train (`megatron_defaults`). A torchtitan job config is read by `torchtitan_config.py`.

`OTHER_TOOLS_FLAGS` is what megapar-train's parser (`training.config.build_parser`), its
`--config` reader and `megapar.prepare`'s keyword check consult before difflib's guess; the
sentences are shared with megapar-plan's own table (`cli/plan.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megapar.models.recipes import recipe_file
from megapar.one_line_parser import LAYOUT_NAMES, TOKENIZER_NAMES, key_without_section


def _recipe_file(name: str) -> str:
    """Where recipe `name`'s config file lies (`recipe_file`: the source tree's models/, else
    the installed copy), to name as one to copy and edit: models/NAME.json was a path only
    inside the source tree."""
    return str(recipe_file(name) or f"models/{name}.json")


WEIGHTS_ONLY = (
    "megapar-train's --load resumes the optimizer state too; to start from a checkpoint's "
    "weights alone, export it (megapar-convert) and start from the export with --from-hf"
)

MODEL_SIZE = (
    "a model's sizes come from --model (a recipe, or a JSON / YAML config file such as "
    f"a copy of {_recipe_file('llama-tiny')}, in transformers' names)"
)

MODEL_FIELD = (
    "a model's settings come from --model (a JSON / YAML model config file such as "
    f"a copy of {_recipe_file('gpt2-tiny')}, in transformers' names): set {{field}} there"
)

MOE_FIELD = (
    "a mixture of experts' routing and sizes come from the model config (a --model file such as "
    f"a copy of {_recipe_file('mixtral-tiny')}, or the config.json of the --from-hf directory, "
    "in transformers' names): set {field} there"
)

ARCHITECTURE = (
    "a model's {what} comes with its family (--model: {how}), as in transformers; drop it"
)

CP_COMM = (
    "--cp-comm-type (with Megatron-core's names: p2p, all_gather, a2a; auto, the default, "
    "chooses per model); torchtitan's allgather is all_gather, alltoall is a2a"
)

MLM_RATE = (
    "megapar masks 15 % of a BERT sample's tokens (80 % [MASK], 10 % a random token, 10 % kept), "
    "a fixed rate; drop it (megapar.data.MLMDataset(..., mask_prob=P) in your own loop)"
)

DS_ZERO = (
    "megapar's ZeRO is built in: give --zero 1, 2 or 3 (with --offload-optimizer, "
    "--offload-params), and a DeepSpeed config's other settings as megapar-train flags "
    "(--config ds_config.json names them for its keys)"
)
DS_CONFIG = (
    "megapar-train reads no DeepSpeed config: give its settings as megapar-train flags (or a "
    "--config file of them): train_batch_size --global-batch-size, "
    "train_micro_batch_size_per_gpu --micro-batch-size, zero_optimization.stage --zero, "
    "offload_optimizer / offload_param --offload-optimizer / --offload-params, bf16 / fp16 "
    "--precision, gradient_clipping --clip-grad (--config ds.json names them for its keys)"
)
FSDP = (
    "megapar's FSDP is --zero 3, its own sharding of parameters, gradients and optimizer state "
    "over the --dp ranks (the Trainer's fsdp full_shard; shard_grad_op is --zero 2, offload "
    "adds --offload-optimizer --offload-params); it reads no FSDP config"
)
TORCHTITAN_CONFIG = (
    "torchtitan's module and config name a Python config of its registry{examples}, which "
    "{tool} cannot read: {instead}"
)
"""What a torchtitan job's --module / --config name is to a megapar command (`tool`), and what
to give it `instead`."""
TORCHTITAN_MODULE = TORCHTITAN_CONFIG.format(
    examples=" (llama3, llama3_8b)",
    tool="megapar-train",
    instead="give the model as --model (a recipe such as llama-8b or llama-tiny, or a JSON / "
    "YAML model config) and the job's settings as megapar-train flags (an older torchtitan's "
    "TOML job config given to --config is translated)",
)
TORCHTITAN_MODULE_API = TORCHTITAN_CONFIG.format(
    examples=" (llama3, llama3_8b)",
    tool="megapar.prepare",
    instead="pass the model (a transformers model, or a recipe name such as 'llama-tiny') and "
    "the job's settings as keywords",
)
GRAD_ACCUM = (
    "megapar-train derives the micro-batches per step: give --global-batch-size (= "
    "--micro-batch-size x the accumulation steps x dp)"
)
CONSECUTIVE_HYSTERESIS = (
    "megapar's --hysteresis is restored when the loss scale grows (Megatron-LM's, and "
    "DeepSpeed's default), not after each clean step; drop it"
)
FP16_OPT_LEVEL = (
    "--precision fp16 (autocast with fp32 weights, gradients and optimizer state: apex's O1 "
    "scheme; there are no fp16 weights as at O2 / O3)"
)
FP16_BACKEND = (
    "megapar's fp16 is torch's autocast with its own loss scaler (--precision fp16), not apex; "
    "drop it"
)
APEX_OPT_LEVEL = (
    "apex's opt levels are megapar's --precision flag: O0 is --precision fp32; O1, O2 and O3 "
    "are --precision fp16 "
    "(autocast with fp32 weights, gradients and optimizer state: apex's O1 scheme; there are "
    "no fp16 weights as at O2 / O3)"
)
FP32_WEIGHTS = (
    "megapar keeps the weights, gradients and optimizer state in fp32 under every --precision "
    "(autocast casts each op's inputs), as apex's O1; drop it"
)
LESS_LAYERS = (
    "torchtitan counts the {part} as that many layers when it cuts the layers evenly over the "
    "(virtual) stages, 1 by default; megapar cuts them evenly by count unless told: "
    "--account-for-{what}-in-pipeline-split counts it as one layer (torchtitan's default), or "
    "--decoder-{end}-pipeline-num-layers N gives the {end} stage (or the model's {end} chunk) "
    "N layers and cuts the rest evenly"
)
INITIAL_SCALE_POWER = "--initial-loss-scale (2 ** the power: 65536 for 16)"
ZERO3_PREFETCH = (
    "megapar's --zero 3 gathers one unit (a block) ahead of the one in use, with no size "
    "setting; --zero3-keep-params keeps every unit gathered; drop it"
)
LAUNCHER_RANK = (
    "megapar-train takes its rank from torchrun's environment (LOCAL_RANK), or starts its "
    "local workers itself; drop it"
)
FP8_ON = "--fp8 tensorwise (or rowwise; megapar converts the blocks' linears itself)"
FP8_RECIPE = (
    "--fp8 tensorwise or rowwise (torchao's recipes of those names; not rowwise_with_gw_hp, "
    "and no delayed scaling: the scales are each tensor's current amax)"
)
FP8_FILTER = (
    "megapar has no per-module float8 filter: --fp8-layers auto keeps the linears torchao's size "
    "rule finds too small (by the layer's whole N x K) in high precision, all converts every "
    "block linear whose dims are multiples of 16, and the embedding and the LM head always stay "
    "in high precision (the run's fp8 line names each kind of layer); drop it"
)
FP8_FSDP_GATHER = (
    "megapar's --zero 3 gathers the --fp8 tensorwise linears' weights as float8 bytes by itself "
    "(not with --compile or --offload-params); drop it"
)
FP8_PRECOMPUTE = (
    "under --zero 3 --fp8 tensorwise the float8 weights' scales come from one all-reduce at each "
    "step's start, always; drop it"
)
FP8_WEIGHT_IN_BWD = (
    "megapar's --zero 3 frees a block's float8 weights with its gathered unit and gathers them "
    "again for its backward; elsewhere one float8 cast of each weight serves the step; drop it"
)
FP8_MOE = (
    "megapar keeps a mixture of experts' routed experts in high precision (torchao's float8 "
    "grouped matmul is a CUDA-only prototype); --fp8 converts attention and shared experts; "
    "drop it"
)
FP8_SCALING = (
    "megapar's float8 scales are dynamic, from each tensor's current amax (torchao's recipes): "
    "no amax history, margin or interval; drop it"
)
FP8_FORMAT = (
    "megapar's float8 casts are torchao's: e4m3 for X and W, e5m2 for dY under --fp8 tensorwise "
    "(Transformer Engine's hybrid), e4m3 for all three under --fp8 rowwise; drop it"
)

FSDP_DEGREE = (
    "--zero 3 (torchtitan's FSDP) over the --dp ranks, which are the ranks divided by --tp x "
    "--cp x --pp"
)
REPLICATE_DEGREE = "--dp (megapar's ZeRO shards over all its dp ranks: no replicas of shards)"
TENSORBOARD = "--tensorboard DIR (scalars written to that directory)"
RESHARD = (
    "--zero3-keep-params for never (reshard_after_forward=False: a unit stays gathered from "
    "its forward to its backward); default and always are megapar's --zero 3 without it"
)
ASYNC_MODE = (
    "--async-save for async and async_with_pinned_mem (megapar copies the state to pinned "
    "host memory itself); disabled: leave it out"
)
MEGATRON_KERNEL = (
    "a Megatron-LM kernel or initialization setting megapar has no counterpart for (torch's "
    "kernels; each rank makes its own parameters); drop it"
)

LR_SAMPLES = (
    "{flag} (megapar counts optimizer steps, not samples: the samples over the global batch size)"
)
CONSTANT_WD = "megapar's weight decay is constant: --weight-decay; drop it"
HF_SCHEDULER = (
    "--lr-decay (linear or cosine with --min-lr 0; cosine_with_min_lr: cosine with a "
    "--min-lr given; constant_with_warmup: constant; warmup_stable_decay: wsd; polynomial "
    "at power 1: linear with --min-lr its lr_end; cosine_with_restarts, inverse_sqrt and "
    "reduce_lr_on_plateau have none)"
)

LAUNCHER = (
    "megapar-train starts its tp x cp x pp x dp local workers itself (give --dp); on several "
    "nodes run it under torchrun or launch/slurm.sbatch (docs/guides/gpus.md)"
)

OTHER_TOOLS_FLAGS = {
    "--resume": "--load",
    "--resume-from-checkpoint": "--load",
    "--ckpt": "--load or --save",
    "--checkpoint": "--load or --save",
    "--checkpoint.folder": "--save (and --load to resume)",
    "--checkpoint.interval": "--save-interval",
    "--train-iters": "--max-steps",
    "--training.steps": "--max-steps",
    "--training.seq_len": "--seq-len",
    "--training.global_batch_size": "--global-batch-size",
    "--training.local_batch_size": "--micro-batch-size",
    **LAYOUT_NAMES,
    "--parallelism.context_parallel_rotate_method": CP_COMM,
    "--hierarchical-context-parallel-sizes": "megapar-train's cp group is one group over all "
    "--cp ranks (a ring, an all-gather or all-to-alls: --cp-comm-type), with no hierarchy; give "
    "the whole size to --cp",
    "--parallelism.expert_tensor_parallel_degree": "--expert-tensor-parallel-size",
    "--use-distributed-optimizer": "--zero 1",
    "--use-tp-pp-dp-mapping": "megapar's default rank order is the one it asks for, "
    "--rank-order tp-pp-dp: drop it (Megatron-LM's own default, tp-cp-ep-dp-pp, is megapar's "
    "--rank-order tp-dp-pp)",
    "--bf16": "--precision bf16",
    "--fp16": "--precision fp16",
    "--fp16-lm-cross-entropy": "megapar's LM-head cross-entropy runs in fp32 on the autocast "
    "dtype's logits (in chunks of --loss-chunk-tokens); drop it",
    "--accumulate-allreduce-grads-in-fp32": "--grad-reduce-dtype fp32 (megapar's gradients "
    "always accumulate in fp32; under --precision fp16 they are reduced in fp16 by default)",
    "--consecutive-hysteresis": CONSECUTIVE_HYSTERESIS,
    "--consecutive_hysteresis": CONSECUTIVE_HYSTERESIS,
    "--fp16_opt_level": FP16_OPT_LEVEL,
    "--fp16-opt-level": FP16_OPT_LEVEL,
    "--half_precision_backend": FP16_BACKEND,
    "--fp16_backend": FP16_BACKEND,
    "--apex": FP16_BACKEND,  # NVIDIA Apex's example scripts, timm's
    "--apex-amp": FP16_BACKEND,
    "--opt-level": APEX_OPT_LEVEL,
    "--opt_level": APEX_OPT_LEVEL,
    "--keep-batchnorm-fp32": FP32_WEIGHTS,
    "--keep_batchnorm_fp32": FP32_WEIGHTS,
    "--master-weights": FP32_WEIGHTS,
    "--master_weights": FP32_WEIGHTS,
    "--lr-decay-style": "--lr-decay (cosine, linear, constant, or wsd for WSD; "
    "inverse-square-root has none)",
    "--lr-warmup-iters": "--warmup-steps (step s of W trains at --lr x (s+1)/W, where Megatron's "
    "first iteration trains at lr 0: its warmup one step ahead, the same from its end on)",
    "--lr-wsd-decay-iters": "--lr-wsd-decay-steps (with --lr-decay wsd)",
    "--lr-wsd-decay-samples": "--lr-wsd-decay-steps with --lr-decay wsd (megapar counts "
    "steps: the samples over the global batch size)",
    "--lr-decay-samples": LR_SAMPLES.format(flag="--lr-decay-steps"),
    "--lr-warmup-samples": LR_SAMPLES.format(flag="--warmup-steps"),
    "--sgd-momentum": "megapar's --optimizer sgd and lars use momentum 0.9 (Megatron-LM's "
    "default); drop it",
    "--lr-warmup-init": "megapar's warmup starts from 0: step s of --warmup-steps W trains at "
    "--lr x (s + 1) / W; drop it",
    "--start-weight-decay": CONSTANT_WD,
    "--end-weight-decay": CONSTANT_WD,
    "--weight-decay-incr-style": CONSTANT_WD,
    "--decoupled-lr": "megapar trains every parameter at one --lr (the embedding and output "
    "layer too); drop it",
    "--decoupled-min-lr": "megapar trains every parameter at one --lr (the embedding and output "
    "layer too); drop it",
    "--override-opt_param-scheduler": "on --load megapar's learning-rate schedule follows the "
    "flags given (a note names what changed from the checkpoint's); drop it",
    "--use-checkpoint-opt_param-scheduler": "on --load the schedule flags not given are the "
    "checkpoint's: give none of --lr, --min-lr, --warmup-steps, --lr-decay, --max-steps",
    # Hugging Face Trainer's (TrainingArguments') optimizer and schedule arguments
    "--lr_scheduler_type": HF_SCHEDULER,
    "--lr-scheduler-type": HF_SCHEDULER,
    "--warmup_ratio": "--warmup-steps (a step count: the ratio x the training steps)",
    "--max_grad_norm": "--clip-grad",
    "--adam_epsilon": "--adam-eps",
    "--optim": "--optimizer (adamw, lamb, lars, sgd or muon; AdamW is torch's fused kernel)",
    "--lr-scheduler-kwargs": "megapar-train's schedule flags: --min-lr (an lr, not a ratio), "
    "--lr-wsd-decay-steps or --lr-wsd-decay-fraction, --lr-wsd-decay-style (decay_type)",
    "--num-train-epochs": "megapar-train counts optimizer steps: give --max-steps (an epoch is "
    "the training split's samples over the global batch size)",
    # nanoGPT's train.py settings (--key=value): difflib named --tokenizer for --block_size,
    # --optimizer for --out_dir, --p2p-dtype for --dtype, nothing for --grad_clip
    "--grad-clip": "--clip-grad",
    "--decay-lr": "--lr-decay constant (decay_lr False; True is the default, --lr-decay cosine)",
    "--block-size": "--seq-len",
    "--out-dir": "--save (checkpoints) and --log-json or --tensorboard (logs)",
    "--dtype": "--precision (fp32, bf16 or fp16)",
    "--init-from": "megapar-train's --load CKPT resumes (init_from resume) and --from-hf DIR "
    "starts from a transformers model (init_from gpt2)",
    "--lr-min": "--min-lr",
    # torchtitan's [optimizer] and [lr_scheduler] (its schedule is always warmup, stable, decay:
    # decay_ratio unset decays over all steps after warmup, megapar's --lr-decay linear)
    "--optimizer.name": "--optimizer (adamw, lamb, lars, sgd or muon)",
    "--optimizer.eps": "--adam-eps",
    "--optimizer.beta1": "--adam-beta1",
    "--optimizer.beta2": "--adam-beta2",
    "--optimizer.weight_decay": "--weight-decay",
    "--optimizer.implementation": "megapar's AdamW is torch's fused kernel on CPU and CUDA; "
    "drop it",
    "--training.max_norm": "--clip-grad",
    "--lr_scheduler.decay_ratio": "--lr-wsd-decay-fraction (with --lr-decay wsd; without "
    "decay_ratio torchtitan decays over all steps after warmup: --lr-decay linear)",
    "--lr_scheduler.decay_type": "--lr-wsd-decay-style (with --lr-decay wsd)",
    "--lr_scheduler.min_lr_factor": "--min-lr (a learning rate, not a factor: --lr x "
    "min_lr_factor)",
    "--lr_scheduler.lr_min": "--min-lr (a learning rate, not a factor: --lr x lr_min)",
    "--eval-iters": "--eval-steps",
    "--data-path": "--data",
    "--train-data-path": "--data (megapar-train holds out --val-fraction of it for validation)",
    "--valid-data-path": "--val-fraction (the share of --data held out for validation; "
    "megapar-eval scores another dataset)",
    "--test-data-path": "megapar-eval --load CKPT --data",
    "--mock-data": "leave --data out: megapar-train then trains on its shipped Shakespeare sample",
    "--calculate-per-token-loss": "--loss-mean token",
    "--use-flash-attn": "megapar runs torch's fused attention (scaled_dot_product_attention) "
    "wherever the mask allows; drop it",
    "--ckpt-format": "megapar's checkpoints are safetensors shards with a manifest (megapar-"
    "convert --from-megatron reads Megatron-LM's torch_dist); drop it",
    "--use-checkpoint-args": "on --load the model and every setting not given are the "
    "checkpoint's (not the layout: --tp, --pp, --dp and how they run are this run's own, and "
    "the checkpoint reshards to them); drop it",
    "--training.dataset_path": "--data",
    "--split": "--val-fraction (the share held out for validation: 949,50,1 is about 0.05, as "
    "whole documents --seed picks rather than a contiguous range; there is no test split)",
    **TOKENIZER_NAMES,
    "--model.tokenizer_path": "--tokenizer",
    "--model.hf_assets_path": "--tokenizer",
    "--num-layers": MODEL_SIZE,
    "--hidden-size": MODEL_SIZE,
    "--ffn-hidden-size": MODEL_SIZE,
    "--num-attention-heads": MODEL_SIZE,
    "--num-query-groups": MODEL_FIELD.format(field="num_key_value_heads"),
    "--group-query-attention": MODEL_FIELD.format(field="num_key_value_heads"),
    "--kv-channels": MODEL_FIELD.format(field="head_dim"),
    "--norm-epsilon": MODEL_FIELD.format(field="rms_norm_eps (GPT-2: layer_norm_epsilon)"),
    "--rotary-base": MODEL_FIELD.format(field="rope_theta"),
    "--untie-embeddings-and-output-weights": "megapar's GPT-2 ties its embedding and output "
    "weights as transformers' does (no untied GPT-2); the Llama-like models are untied unless "
    "their config sets tie_word_embeddings: drop it",
    "--disable-bias-linear": MODEL_FIELD.format(
        field="attention_bias and mlp_bias (a Llama-like family's; GPT-2 and BERT have biases)"
    ),
    "--normalization": ARCHITECTURE.format(
        what="normalisation", how="LayerNorm for GPT-2 and BERT, RMSNorm for the others"
    ),
    "--swiglu": ARCHITECTURE.format(
        what="MLP",
        how="SwiGLU for Llama, Mistral, Qwen and the MoE experts, GELU for GPT-2 and BERT",
    ),
    "--position-embedding-type": ARCHITECTURE.format(
        what="position embedding", how="RoPE for the Llama-like ones, learned for GPT-2 and BERT"
    ),
    "--use-rotary-position-embeddings": ARCHITECTURE.format(
        what="position embedding", how="RoPE for the Llama-like ones, learned for GPT-2 and BERT"
    ),
    "--qk-layernorm": ARCHITECTURE.format(
        what="query / key norm", how="Qwen3's and Qwen3-MoE's, none in the others"
    ),
    "--use-mcore-models": "megapar has one implementation of each model; drop it",
    "--transformer-impl": "megapar has one implementation of each model (torch's kernels; "
    "--fp8 for float8 linears); drop it",
    "--distributed-timeout-minutes": "--timeout-s (seconds) and --nccl-timeout-s",
    "--max-position-embeddings": MODEL_SIZE,
    "--recompute-activations": "--recompute selective",
    "--recompute-granularity": "--recompute",
    **dict.fromkeys(
        ("--recompute-method", "--recompute-num-layers"),
        "megapar's --recompute full recomputes every block of a stage and selective each "
        "attention core (no uniform / block method, no layer count); drop it",
    ),
    "--activation_checkpoint.mode": "--recompute",
    "--gradient-checkpointing": "--recompute full",
    "--gradient_checkpointing": "--recompute full",
    "--training.mixed_precision_param": "--precision",
    "--optimizer.lr": "--lr",
    "--learning_rate": "--lr",
    "--lr-decay-iters": "--lr-decay-steps",
    "--lr-warmup-fraction": "--warmup-steps (a step count: the fraction x the decay's steps)",
    "--lr_scheduler.warmup_steps": "--warmup-steps",
    "--load-optim": "--load",
    "--no-load-optim": WEIGHTS_ONLY,
    "--finetune": WEIGHTS_ONLY,
    "--no-load-rng": "on --load megapar-train continues the checkpoint's random state (a "
    "resumed run equals an unbroken one); drop it",
    "--log-params-norm": "megapar-train logs the gradient norm each step (grad_norm), not the "
    "parameters'; drop it",
    "--use-torch-fsdp2": "--zero 3 (megapar's own sharding of parameters, gradients and "
    "optimizer state over the --dp ranks)",
    "--data-parallel-sharding-strategy": "--zero (optim: 1, optim_grads: 2, optim_grads_params: 3)",
    "--yaml-cfg": "--config (a YAML or JSON file of megapar-train's flags)",
    "--DDP-impl": "megapar's data parallelism is its own bucketed reduction (--zero for "
    "sharding); drop it",
    "--no-async-tensor-model-parallel-allreduce": MEGATRON_KERNEL,
    "--use-cpu-initialization": MEGATRON_KERNEL,
    "--no-gradient-accumulation-fusion": MEGATRON_KERNEL,
    "--no-masked-softmax-fusion": MEGATRON_KERNEL,
    "--no-bias-gelu-fusion": MEGATRON_KERNEL,
    "--no-bias-dropout-fusion": MEGATRON_KERNEL,
    "--no-persist-layer-norm": MEGATRON_KERNEL,
    # torchtitan's job config keys (`torchtitan_config.toml_job_config`); difflib named
    # --debug for debug.seed, --expert-tensor-parallel-size for tensor_parallel_degree,
    # nothing for training.seed
    "--training.seed": "--seed",
    "--debug.seed": "--seed",
    "--metrics.log_freq": "--log-interval",
    "--log-freq": "--log-interval",
    "--metrics.enable_tensorboard": TENSORBOARD,
    "--metrics.save_tb_folder": TENSORBOARD,
    "--metrics.enable_wandb": "--wandb-project NAME (offline where there is no network)",
    "--parallelism.pipeline_parallel_microbatch_size": "--micro-batch-size",
    "--parallelism.fsdp_reshard_after_forward": RESHARD,
    "--checkpoint.keep_latest_k": "--keep-latest-k",
    "--checkpoint.async_mode": ASYNC_MODE,
    "--checkpoint.enable": "--save DIR",
    "--checkpoint.load_step": "--load DIR/step_XXXXXXXX (a step's directory; --load DIR "
    "takes its latest)",
    "--checkpoint.initial_load_path": "a megapar checkpoint is --load, a transformers "
    "directory --from-hf; a DCP checkpoint is converted first (megapar-convert --from-dcp)",
    "--checkpoint.last_save_in_hf": "megapar-convert CKPT --to-hf DIR writes a transformers "
    "model of any megapar checkpoint; drop it",
    "--comm.init_timeout_seconds": "--timeout-s",
    "--comm.train_timeout_seconds": "--timeout-s",
    "--profiling.enable_profiling": "--profile-steps A:B (a torch.profiler trace of those steps)",
    "--local-batch-size": "--micro-batch-size",
    "--steps": "--max-steps",
    "--flavor": "--model (a recipe such as llama-1b, or a config.json of the flavor's sizes)",
    "--parallelism.data_parallel_shard_degree": FSDP_DEGREE,
    "--data-parallel-shard-degree": FSDP_DEGREE,  # without its section
    "--parallelism.data_parallel_replicate_degree": REPLICATE_DEGREE,
    "--data-parallel-replicate-degree": REPLICATE_DEGREE,
    "--model.flavor": "--model (a recipe such as llama-1b, or a config.json of the flavor's "
    "sizes: megapar-convert reads torchtitan's Llama 3 flavors from a job config)",
    "--model.name": "--model (a recipe such as llama-1b, or a config.json)",
    "--module": TORCHTITAN_MODULE,
    **dict.fromkeys(
        ("--prompt", "--prompt-file", "--max-new-tokens", "--temperature", "--top-k", "--top-p"),
        "megapar-generate continues prompts with a checkpoint (megapar-generate --load CKPT "
        "--prompt TEXT --max-new-tokens N); megapar-train trains",
    ),
    "--job.dump_folder": "--save (checkpoints) and --log-json or --tensorboard (logs)",
    "--training.dataset": "--data (a text file, directory or dataset on disk; nothing is "
    "downloaded)",
    "--activation_checkpoint.selective_ac_option": "megapar's --recompute selective recomputes "
    "each layer's attention core (Megatron's selective), with no op-level policy or every Nth "
    "layer; drop it",
    # DeepSpeed's flags and ds_config.json keys (`--config` takes a file of megapar-train's
    # flags; `read_run_config` names a DeepSpeed config's equivalents): difflib named
    # --micro-batch-size for train_batch_size (the global batch), --loss-mean for --loss-scale,
    # --adam-eps for --num-gpus, --load for --cpu-offload, or nothing (--gradient-clipping,
    # --checkpoint-activations, --gradient-accumulation-steps, --local_rank)
    "--deepspeed": DS_ZERO,
    "--deepscale": DS_ZERO,
    "--deepspeed_config": DS_CONFIG,
    "--deepspeed-config": DS_CONFIG,
    "--deepscale_config": DS_CONFIG,
    "--zero-stage": "--zero",
    "--stage": "--zero",  # a ZeRO stage (DeepSpeed's zero_optimization.stage)
    "--zero_optimization.stage": "--zero",
    "--zero_optimization.offload_optimizer.device": "--offload-optimizer (to the host; no NVMe)",
    "--zero_optimization.offload_param.device": "--offload-params (to the host; no NVMe)",
    "--zero_optimization.stage3_param_persistence_threshold": "--zero3-persistence-threshold",
    "--zero_optimization.reduce_bucket_size": "--grad-bucket-mb (MB of fp32 gradients: "
    "elements x 4 / 2^20)",
    "--fp16.enabled": "--precision fp16",
    "--bf16.enabled": "--precision bf16",
    "--fp16.loss_scale": "--loss-scale (a static scale; DeepSpeed's 0, dynamic, is megapar's "
    "default)",
    "--fp16.initial_scale_power": INITIAL_SCALE_POWER,
    "--fp16.loss_scale_window": "--loss-scale-window",
    "--fp16.min_loss_scale": "--min-loss-scale",
    "--fp16.hysteresis": "--hysteresis",
    "--fp16.consecutive_hysteresis": CONSECUTIVE_HYSTERESIS,
    "--optimizer.params.lr": "--lr",
    "--optimizer.params.eps": "--adam-eps",
    "--optimizer.params.weight_decay": "--weight-decay",
    "--optimizer.params.betas": "--adam-beta1 and --adam-beta2",
    "--scheduler.params.warmup_num_steps": "--warmup-steps",
    "--scheduler.params.total_num_steps": "--max-steps",
    "--scheduler.params.warmup_max_lr": "--lr",
    "--scheduler.params.warmup_min_lr": "--min-lr",
    "--zero_stage": "--zero",
    "--zero-optimization": DS_ZERO,
    "--zero_optimization": DS_ZERO,
    "--train-batch-size": "--global-batch-size",
    "--train_batch_size": "--global-batch-size",
    "--train-micro-batch-size-per-gpu": "--micro-batch-size",
    "--train_micro_batch_size_per_gpu": "--micro-batch-size",
    "--gradient-accumulation-steps": GRAD_ACCUM,
    # other spellings of it (nanoGPT's, Lightning's, ...): difflib named --adam-eps,
    # --warmup-steps, --max-steps, --grad-bucket-mb, or nothing
    **dict.fromkeys(
        (
            "--grad-accum-steps",
            "--grad-accum",
            "--gradient-accumulation",
            "--accumulation-steps",
            "--accum-steps",
        ),
        GRAD_ACCUM,
    ),
    "--loss-scale-power": INITIAL_SCALE_POWER,  # difflib: --loss-scale-window
    # a re-test's: difflib named --ep (expert parallelism), --schedule (the pipeline's),
    # --no-progress and --muon-momentum
    **dict.fromkeys(
        ("--epochs", "--num-epochs"),
        "megapar-train counts optimizer steps: --max-steps (an epoch is the training split's "
        "samples over the global batch)",
    ),
    "--scheduler": "--lr-decay (the learning rate's schedule; --schedule is the pipeline's)",
    "--num-processes": "--dp",
    "--momentum": "megapar's sgd and lars use momentum 0.9 (Muon's is --muon-momentum); drop it",
    "--activation-checkpointing": "--recompute full",
    "--ddp-backend": "megapar-train chooses the backend by the device: gloo on CPU ranks, NCCL "
    "on GPUs; drop it",
    "--cpu-offload": "--offload-optimizer",
    "--cpu_offload": "--offload-optimizer",
    "--cpu-optimizer": "--offload-optimizer",
    # megapar-plan's --offload (the offloads its search tries) and FSDP's offload: difflib
    # named --load
    "--offload": "--offload-optimizer (and --offload-params under --zero 3: its parameter "
    "shards too)",
    "--loss_scale": "--loss-scale (a static scale; DeepSpeed's 0, dynamic, is megapar's default)",
    "--initial-scale-power": INITIAL_SCALE_POWER,
    "--initial_scale_power": INITIAL_SCALE_POWER,
    "--dynamic-loss-scale": "megapar's fp16 loss scale is dynamic unless --loss-scale S is "
    "given: drop it",
    "--dynamic_loss_scale": "megapar's fp16 loss scale is dynamic unless --loss-scale S is "
    "given: drop it",
    "--no-dynamic-loss-scale": "a static fp16 loss scale is --loss-scale S (megapar's is "
    "dynamic without it)",
    "--loss_scale_window": "--loss-scale-window",
    "--min_loss_scale": "--min-loss-scale",
    "--initial_loss_scale": "--initial-loss-scale",
    "--gradient-clipping": "--clip-grad",
    "--gradient_clipping": "--clip-grad",
    "--checkpoint-activations": "--recompute full",
    "--checkpoint_activations": "--recompute full",
    "--deepspeed-activation-checkpointing": "--recompute full",
    "--partition-activations": "megapar keeps each rank's recomputation inputs whole; "
    "--sequence-parallel (with --tp) splits the activations outside attention and the MLP over "
    "the tp ranks",
    "--steps_per_print": "--log-interval",
    "--steps-per-print": "--log-interval",
    "--wall_clock_breakdown": "every log line has the step's throughput (tok/s, TFLOP/s, MFU) "
    "and, with --pp, the bubble; --profile-steps A:B records a torch.profiler trace",
    "--reduce-bucket-size": "--grad-bucket-mb (MB, where DeepSpeed counts elements)",
    "--reduce_bucket_size": "--grad-bucket-mb (MB, where DeepSpeed counts elements)",
    "--allgather-bucket-size": "--grad-bucket-mb (MB; ZeRO-1 / 2 gather the buckets the "
    "reduction uses)",
    "--overlap-comm": "megapar-train always overlaps the gradient reduction with the backward "
    "(buckets of --grad-bucket-mb); drop it",
    "--overlap_comm": "megapar-train always overlaps the gradient reduction with the backward "
    "(buckets of --grad-bucket-mb); drop it",
    "--contiguous-gradients": "megapar's gradients always live in flat buckets; drop it",
    "--contiguous_gradients": "megapar's gradients always live in flat buckets; drop it",
    "--stage3-prefetch-bucket-size": ZERO3_PREFETCH,
    "--stage3_prefetch_bucket_size": ZERO3_PREFETCH,
    "--stage3-max-live-parameters": ZERO3_PREFETCH,
    "--stage3_max_live_parameters": ZERO3_PREFETCH,
    "--stage3-param-persistence-threshold": "--zero3-persistence-threshold",
    "--stage3_param_persistence_threshold": "--zero3-persistence-threshold",
    "--local_rank": LAUNCHER_RANK,
    "--local-rank": LAUNCHER_RANK,
    "--num_gpus": LAUNCHER,
    "--num-gpus": LAUNCHER,
    "--num_nodes": LAUNCHER,
    "--num-nodes": LAUNCHER,
    "--hostfile": LAUNCHER,
    "--include": LAUNCHER,
    "--master_port": LAUNCHER,
    "--master_addr": LAUNCHER,
    "--job.config_file": "--config",
    "--tensorboard-dir": "--tensorboard",
    "--output-dir": "--save",  # covers --output_dir too
    "--fsdp": FSDP,
    "--fsdp-config": FSDP,
    "--fsdp_config": FSDP,
    "--per-device-train-batch-size": "--micro-batch-size (the accumulation steps are "
    "--global-batch-size over micro-batch x dp; its default is 16)",
    # more of the Trainer's (TrainingArguments'): a dashed entry covers both spellings, and
    # difflib named --max-steps for --save_steps, --record-step for --report_to
    "--learning-rate": "--lr",
    "--max-grad-norm": "--clip-grad",
    "--warmup-ratio": "--warmup-steps (a step count: the ratio x the training steps)",
    "--save-steps": "--save-interval",
    "--save-total-limit": "--keep-latest-k",
    "--save-strategy": "--save-interval (megapar saves every --save-interval steps)",
    "--logging-steps": "--log-interval",
    "--logging-dir": "--tensorboard DIR",
    "--report-to": "--wandb-project NAME or --tensorboard DIR",
    "--run-name": "--wandb-project NAME, and the environment's WANDB_NAME for the run's name",
    "--overwrite-output-dir": "megapar-train continues the checkpoints in --save (a new run "
    "refuses a --save holding another run's newer steps: --overwrite-newer replaces those); "
    "to start afresh give another --save",
    "--eval_steps": "--eval-interval (steps between evaluations; megapar-train's own "
    "--eval-steps is the validation batches each evaluation reads)",
    "--eval-strategy": "--eval-interval (megapar evaluates every --eval-interval steps)",
    "--evaluation-strategy": "--eval-interval (megapar evaluates every --eval-interval steps)",
    "--per-device-eval-batch-size": "megapar evaluates with the training batch "
    "(--micro-batch-size, --global-batch-size); drop it",
    "--dataloader-num-workers": "megapar reads memory-mapped token files in each rank's own "
    "process (no loader workers to set); drop it",
    "--do-train": "megapar-train trains (megapar-eval evaluates a checkpoint); drop it",
    "--do-eval": "megapar-train evaluates every --eval-interval steps (megapar-eval a "
    "checkpoint); drop it",
    "--gradient_accumulation_steps": GRAD_ACCUM,
    "--grad-accumulation-steps": GRAD_ACCUM,  # a shortening difflib matched to nothing
    "--grad_accumulation_steps": GRAD_ACCUM,
    "--accumulate-grad-batches": GRAD_ACCUM,  # Lightning's Trainer(accumulate_grad_batches)
    "--model_name_or_path": "--from-hf",
    "--nproc_per_node": "--dp",
    "--nproc-per-node": "--dp",
    "--virtual-pipeline-model-parallel-size": "--schedule interleaved --virtual-stages",
    "--num-virtual-stages-per-pipeline-rank": "--schedule interleaved --virtual-stages",
    "--num-layers-per-virtual-pipeline-stage": "--schedule interleaved --virtual-stages (model "
    "chunks per rank: the layers over --pp x the layers of a chunk)",
    "--parallelism.pipeline_parallel_schedule": "--schedule",
    "--parallelism.pipeline_parallel_first_stage_less_layers": LESS_LAYERS.format(
        part="embedding", end="first", what="embedding"
    ),
    "--parallelism.pipeline_parallel_last_stage_less_layers": LESS_LAYERS.format(
        part="output layer", end="last", what="loss"
    ),
    "--parallelism.pipeline_parallel_layers_per_stage": "--schedule interleaved "
    "--virtual-stages (model chunks per rank: the layers over --pp x the layers of a chunk), "
    "or --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers for the first "
    "and last chunk's",
    "--pipeline-model-parallel-layout": "megapar has no per-stage layout string: it cuts the "
    "layers evenly over the stages (or pp x V chunks) with the first and last given their own "
    "counts by --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers, or the "
    "embedding and loss counted as a layer by --account-for-embedding-in-pipeline-split / "
    "--account-for-loss-in-pipeline-split",
    "--train-samples": "megapar-train counts steps: give --max-steps, the samples over "
    "--global-batch-size",
    "--rampup-batch-size": "megapar-train has no batch-size ramp-up: stop each phase (e.g. "
    "--exit-interval) and resume with --load and the next --global-batch-size, which continues "
    "the data order",
    "--overlap-grad-reduce": "megapar-train always overlaps the gradient reduction with the "
    "backward (buckets of --grad-bucket-mb); drop it",
    "--overlap-param-gather": "megapar-train's ZeRO gathers overlap the compute where they can; "
    "drop it",
    "--distributed-backend": "megapar-train picks gloo on the CPU and NCCL with CUDA "
    "(MEGAPAR_CPU=1 forces the CPU); drop it",
    "--log-throughput": "tokens/s, TFLOP/s and MFU are on every log line; drop it",
    "--tensorboard-log-interval": "--tensorboard gets every step's scalars; drop it",
    "--log-validation-ppl-to-tensorboard": "megapar's --tensorboard DIR logs val_ppl beside "
    "val_loss; drop it",
    "--sp": "--sequence-parallel",
    "--etp": "--expert-tensor-parallel-size",
    # torchtitan's float8 options (`--float8.*`, since 2025 `--quantize.linear.float8.*`),
    # Megatron-LM's / Transformer Engine's fp8 flags: difflib named --load for --float8,
    # --fp8-emulate for --fp8-recipe and --fp8-format, or nothing
    "--float8": FP8_ON,
    "--model.converters": FP8_ON,
    "--float8.enable_float8_linear": FP8_ON,
    "--float8.recipe_name": FP8_RECIPE,
    "--quantize.linear.float8.recipe_name": FP8_RECIPE,
    "--recipe_name": FP8_RECIPE,
    "--fp8-recipe": FP8_RECIPE,
    "--float8.filter_fqns": FP8_FILTER,
    "--quantize.linear.float8.filter_fqns": FP8_FILTER,
    "--filter_fqns": FP8_FILTER,
    "--float8.emulate": "--fp8-emulate",
    "--quantize.linear.float8.emulate": "--fp8-emulate",
    "--float8.enable_fsdp_float8_all_gather": FP8_FSDP_GATHER,
    "--quantize.linear.float8.enable_fsdp_float8_all_gather": FP8_FSDP_GATHER,
    "--enable_fsdp_float8_all_gather": FP8_FSDP_GATHER,
    "--fp8-param-gather": FP8_FSDP_GATHER,
    "--float8.precompute_float8_dynamic_scale_for_fsdp": FP8_PRECOMPUTE,
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": FP8_PRECOMPUTE,
    "--precompute_float8_dynamic_scale_for_fsdp": FP8_PRECOMPUTE,
    "--float8.force_recompute_fp8_weight_in_bwd": FP8_WEIGHT_IN_BWD,
    "--float8.moe_fqns_prototype": FP8_MOE,
    "--quantize.grouped_mm.float8.fqns": FP8_MOE,
    "--fp8-format": FP8_FORMAT,
    "--fp8-margin": FP8_SCALING,
    "--fp8-interval": FP8_SCALING,
    "--fp8-amax-history-len": FP8_SCALING,
    "--fp8-amax-compute-algo": FP8_SCALING,
    "--no-fp8-wgrad": "megapar's float8 linears compute dW = dY^T X in float8 too, as "
    "torchao's tensorwise and rowwise recipes do (rowwise_with_gw_hp is not offered); drop it",
    "--fp8-dot-product-attention": "megapar keeps attention's core in high precision under "
    "--fp8; drop it",
    "--fp8-multi-head-attention": "megapar keeps attention's core in high precision under "
    "--fp8; drop it",
    "--first-last-layers-bf16": "megapar treats every block's linears alike under --fp8 (by "
    "--fp8-layers); drop it",
    "--training.compile": "--compile",
    "--compile.enable": "--compile",
    # Megatron-LM's mixture-of-experts flags (difflib named --adam-eps for --num-experts,
    # --moe-capacity-factor for --moe-router-topk-scaling-factor, --tp for --sp)
    "--num-experts": MOE_FIELD.format(field="num_local_experts (Qwen3-MoE: num_experts)"),
    "--moe-router-topk": MOE_FIELD.format(field="num_experts_per_tok"),
    "--num-experts-per-tok": MOE_FIELD.format(field="num_experts_per_tok"),
    "--moe-top-k": MOE_FIELD.format(field="num_experts_per_tok"),
    **dict.fromkeys(
        ("--gpu", "--gpu-type", "--gpu-model"),
        "megapar-train runs on the GPUs it is given (one a rank: CUDA_VISIBLE_DEVICES, or "
        "torchrun's local ranks), whatever their model; with --dry-run, --gpu-memory-gb is "
        "each GPU's memory",
    ),
    "--moe-ffn-hidden-size": MOE_FIELD.format(
        field="moe_intermediate_size (Qwen3-MoE; a Mixtral's experts are intermediate_size wide)"
    ),
    "--moe-layer-freq": MOE_FIELD.format(
        field="decoder_sparse_step and mlp_only_layers (Qwen3-MoE)"
    ),
    "--moe-shared-expert-intermediate-size": MOE_FIELD.format(
        field="shared_expert_intermediate_size"
    ),
    "--moe-router-score-function": MOE_FIELD.format(field="moe_router_score (softmax or sigmoid)"),
    # packed documents: Megatron-LM's --reset-attention-mask (its --reset-position-ids and
    # --eod-mask-loss are megapar's names too) and torchtitan's attn_mask_type
    "--reset-attention-mask": "--attention-mask-type block_causal",
    "--reset_attention_mask": "--attention-mask-type block_causal",
    "--attn-mask-type": "--attention-mask-type",
    "--attn_mask_type": "--attention-mask-type",
    "--model.attn_mask_type": "--attention-mask-type",
    "--reset_position_ids": "--reset-position-ids",
    "--eod_mask_loss": "--eod-mask-loss",
    "--label-smoothing-factor": "--label-smoothing",
    "--label_smoothing_factor": "--label-smoothing",
    "--z-loss-multiplier": "--z-loss",
    # difflib named the router's --moe-z-loss-coef, which a dense model refuses
    "--z-loss-coef": "--z-loss (the output z-loss; --moe-z-loss-coef is a mixture of experts' "
    "router z-loss)",
    "--z_loss_multiplier": "--z-loss",
    "--auxiliary-loss-multiplier": "--z-loss",
    "--softmax-auxiliary-loss-scale": "--z-loss",
    "--softmax_auxiliary_loss_scale": "--z-loss",
    "--auxiliary_loss_multiplier": "--z-loss",
    "--softmax-auxiliary-loss": "--z-loss COEF (OLMo's auxiliary_loss_multiplier, e.g. 1e-4)",
    "--softmax_auxiliary_loss": "--z-loss COEF (OLMo's auxiliary_loss_multiplier, e.g. 1e-4)",
    "--moe-aux-loss-coeff": "--moe-aux-loss-coef",
    "--router-aux-loss-coef": "--moe-aux-loss-coef",
    "--moe-z-loss-coeff": "--moe-z-loss-coef",
    "--moe-expert-capacity-factor": "--moe-capacity-factor",
    "--moe-token-dropping": "megapar drops an expert's tokens over its capacity with "
    "--moe-capacity-factor C (not given: dropless)",
    "--moe-router-bias-update-rate": "--moe-bias-update-rate",
    "--moe-router-enable-expert-bias": (
        "--moe-bias-update-rate (a rate > 0 turns the expert bias on)"
    ),
    "--moe-router-load-balancing-type": "--moe-aux-loss-coef (aux_loss; 0: none), "
    "--moe-z-loss-coef and --moe-bias-update-rate (DeepSeek-V3's auxiliary-loss-free balancing)",
    "--moe-token-dispatcher-type": "under --ep the experts' tokens always travel by all-to-all "
    "(Megatron's alltoall dispatcher); drop it",
    "--moe-grouped-gemm": "the experts run one grouped matmul per projection by themselves on "
    "CUDA in bf16 (a loop over the experts elsewhere); drop it",
    "--moe-token-drop-policy": "with --moe-capacity-factor each expert keeps its first "
    "assignments in token order (Megatron's position policy); drop it",
    "--moe-pad-expert-input-to-capacity": "megapar never pads an expert's rows to its capacity; "
    "drop it",
    "--moe-router-topk-scaling-factor": "megapar's router weighs the top-k experts by their "
    "scores (renormalised for a Mixtral, and for a Qwen3-MoE whose norm_topk_prob says so), with "
    "no scaling factor; drop it",
    "--moe-use-legacy-grouped-gemm": "the experts run one grouped matmul per projection by "
    "themselves on CUDA in bf16 (a loop over the experts elsewhere); drop it",
    "--moe-permute-fusion": "megapar sorts the routed rows by expert and gathers them with "
    "torch's kernels (no fused permute); drop it",
    "--moe-router-fusion": "megapar's router runs with torch's kernels (no fused router); drop it",
    "--moe-extended-tp": "Megatron's extended tp split each expert over tp x ep; megapar splits "
    "each expert over tp with --expert-tensor-parallel-size (the --tp size) and spreads the "
    "experts over --ep",
    # a Megatron-LM user's re-test: these were "did you mean" an unrelated flag, or nothing
    "--attention-softmax-in-fp32": MEGATRON_KERNEL,
    "--apply-query-key-layer-scaling": MEGATRON_KERNEL,
    "--cross-entropy-loss-fusion": "megapar's loss is its own chunked vocab-parallel cross-"
    "entropy (the logits never whole); drop it",
    "--timing-log-level": "megapar-train's log line times every step (--log-json adds each "
    "rank's compute and wait); drop it",
    "--no-save-optim": "megapar's checkpoints hold the optimizer state a resume needs "
    "(megapar-convert --to-hf writes the weights alone); drop it",
    "--no-save-rng": "megapar's checkpoints hold every rank's random state; drop it",
    "--ckpt-step": "--load DIR/step_XXXXXXXX (a step's directory; --load DIR takes its latest)",
    "--sequence-parallel-size": "--cp N --cp-comm-type a2a (DeepSpeed-Ulysses' all-to-all "
    "context parallelism; megapar's --sequence-parallel is Megatron-LM's, over the tp ranks)",
    "--openai-gelu": MODEL_FIELD.format(
        field="activation_function gelu_new (the GPT-2 default; Megatron-LM's default is gelu)"
    ),
    "--check-for-nan-in-loss-and-grad": "megapar-train checks every step's loss and gradient "
    "norm (--max-nonfinite-steps sets how many bad steps in a row stop the run); drop it",
    "--deterministic-mode": "megapar sets no deterministic-algorithms switch of its own; drop it",
    **dict.fromkeys(
        ("--use-dist-ckpt", "--auto-detect-ckpt-format", "--dist-ckpt-strictness"),
        "megapar's checkpoints are safetensors shards with a manifest, resharded to any layout "
        "on --load (megapar-convert --from-megatron reads Megatron-LM's torch_dist); drop it",
    ),
    "--pretrained-checkpoint": "megapar-train starts from --load CKPT (megapar's; "
    "megapar-convert --from-megatron imports Megatron-LM's) or --from-hf DIR (a transformers "
    "model)",
    "--empty-unused-memory-level": "megapar leaves the CUDA cache to torch's allocator; drop it",
    "--ddp-average-in-collective": "megapar's gradient reduction averages over dp itself; drop it",
    **dict.fromkeys(
        (
            "--rotary-percent",
            "--fp32-residual-connection",
            "--apply-layernorm-1p",
            "--squared-relu",
            "--num-distributed-optimizer-instances",
            "--log-num-zeros-in-grad",
            "--manual-gc",
        ),
        "a Megatron-LM setting megapar has no counterpart for; drop it",
    ),
    "--tp-comm-overlap-ag": "megapar-train does not split the linears' matmuls to overlap their "
    "tp collectives; drop it",
    "--tp-comm-overlap": "megapar-train does not split the linears' matmuls to overlap their tp "
    "collectives (Transformer Engine's userbuffers); with --sequence-parallel --sp-regather the "
    "backward's re-gather overlaps an input-gradient matmul, as Megatron's; drop it",
    "--moe-router-dtype": "megapar's router takes the softmax (or sigmoid) of its logits in fp32 "
    "under every --precision; drop it",
    "--moe-input-jitter-eps": "megapar's router adds no input jitter; drop it",
    "--moe-layer-recompute": "--recompute full (--recompute selective recomputes the attention "
    "core only, never the MoE layer)",
    "--init-method-std": MODEL_FIELD.format(field="initializer_range"),
    "--hidden-dropout": MODEL_FIELD.format(field="resid_pdrop (GPT-2), hidden_dropout_prob (BERT)"),
    "--attention-dropout": MODEL_FIELD.format(
        field="attn_pdrop (GPT-2), attention_probs_dropout_prob (BERT), attention_dropout (Llama)"
    ),
    # nanoGPT's model and system settings, and the short names a user tries first (difflib
    # named --fp8-layers for --n_layer, --recompute for --dropout, --dp for --wd, --seed for
    # --bs, --tp for --amp, --tb and --out, --model for --nodes)
    "--n-layer": MODEL_SIZE,
    "--n-head": MODEL_SIZE,
    "--n-embd": MODEL_SIZE,
    "--layers": MODEL_SIZE,
    "--heads": MODEL_SIZE,
    "--dropout": MODEL_FIELD.format(field="resid_pdrop, embd_pdrop and attn_pdrop (GPT-2)"),
    "--bias": "megapar's GPT-2 has its biases as transformers' does and its Llama-like models "
    "none; drop it",
    "--device": "megapar-train runs on CUDA where a GPU is present (one a rank), else on the CPU "
    "with gloo (MEGAPAR_CPU=1 runs on the CPU beside a GPU); drop it",
    "--backend": "megapar-train takes NCCL on GPUs and gloo on the CPU; drop it",
    "--always-save-checkpoint": "--save DIR --save-interval N (every N steps, whatever the "
    "validation loss)",
    "--bs": "--micro-batch-size (per rank) or --global-batch-size (per optimizer step)",
    "--batch": "--micro-batch-size (per rank) or --global-batch-size (per optimizer step)",
    "--batch-size": "--micro-batch-size (per rank; nanoGPT's batch_size) or --global-batch-size "
    "(per optimizer step)",
    "--mbs": "--micro-batch-size",
    "--gbs": "--global-batch-size",
    "--wd": "--weight-decay",
    "--tb": "--tensorboard",
    "--out": "--save (checkpoints) and --log-json or --tensorboard (logs)",
    "--nodes": LAUNCHER,
    "--nnodes": LAUNCHER,
    "--amp": "--precision bf16 (or fp16)",
    "--iters": "--max-steps",
    "--sched": "--lr-decay (the learning rate's schedule; --schedule is the pipeline's)",
    "--lr-scheduler": "--lr-decay (the learning rate's schedule; --schedule is the pipeline's)",
    "--decay": "--lr-decay",
    "--gpus": "megapar-train's processes are tp x cp x pp x dp, one GPU each (give --dp); on "
    "several nodes run it under torchrun or launch/slurm.sbatch (--gpus-per-node is the dry "
    "run's node size)",
    "--n-gpu": LAUNCHER,
    "--wandb-log": "--wandb-project NAME",
    "--wandb": "--wandb-project NAME",
    **dict.fromkeys(
        ("--use-cpu", "--no-cuda"),
        "megapar-train runs on the GPUs it finds, one a rank, and on the CPU without them (or "
        "with MEGAPAR_CPU=1); drop it",
    ),
    "--disable-tqdm": "--no-progress",
    "--warmup": "--warmup-steps",
    "--mixed-precision": "--precision bf16 (or fp16)",
    "--use-wandb": "--wandb-project NAME",
    "--eval": "--eval-interval N (steps between evaluations; megapar-eval a checkpoint)",
    "--eval-only": "megapar-eval --load CKPT --data DATA (evaluation alone)",
    "--log": "--log-interval N (every N steps), --log-json FILE or --tensorboard DIR",
    "--log-dir": "--log-json FILE or --tensorboard DIR",
    "--zero1": "--zero 1",
    "--zero2": "--zero 2",
    "--zero3": "--zero 3",
    # Megatron-LM's and transformers' (run_mlm.py) BERT pretraining flags
    "--mask-prob": MLM_RATE,
    "--masked-lm-prob": MLM_RATE,
    "--mlm-probability": MLM_RATE,
    "--mlm_probability": MLM_RATE,
    "--mlm": "a BERT model always trains the masked-LM loss (a GPT-2 or Llama the causal one); "
    "drop it",
    "--whole-word-masking": "megapar masks single tokens (a word's WordPiece pieces "
    "independently), not whole words; drop it",
    "--whole_word_mask": "megapar masks single tokens (a word's WordPiece pieces "
    "independently), not whole words; drop it",
    "--bert-no-binary-head": "megapar's BERT has no next-sentence (binary) head: it trains the "
    "masked-LM loss only, as this flag asks of Megatron-LM; drop it",
    "--bert-binary-head": "megapar's BERT has no next-sentence (binary) head: it trains the "
    "masked-LM loss only; drop it",
    "--short-seq-prob": "megapar's BERT samples are each document's consecutive chunks of "
    "--seq-len - 3 tokens, none shortened at random; drop it",
    "--data-impl": "megapar reads Megatron-LM's mmap datasets (MMIDIDX .bin / .idx) as they "
    "are; drop it",
    "--num-workers": "megapar-train collates each batch in the training process (a few index "
    "lookups per sample); drop it",
    "--dataloader-type": "megapar-train's sampler reshuffles the samples every epoch (as "
    "Megatron-LM's cyclic); drop it",
    "--bert-load": "--from-hf DIR (a transformers BERT directory) or --load CKPT (a megapar "
    "checkpoint)",
    "--make-vocab-size-divisible-by": MODEL_FIELD.format(field="make_vocab_size_divisible_by"),
    # the other megapar commands' flags
    "--input": "--data",
    "--split-lines": "megapar-train already reads a .txt as a document per blank-line "
    "paragraph; drop it",
    "--output-prefix": "megapar-train keeps raw text's tokens in --data-cache; to write a "
    "dataset, run megapar-data, then pass its prefix to --data",
    "--workers": "megapar-data's tokenizer processes; to tokenize a big corpus in parallel, run "
    "megapar-data first and pass its prefix to --data",
    "--vocab-size": "the vocabulary follows the tokenizer (or a --model config file's vocab_size)",
    "--to-hf": "export the checkpoint after training: megapar-convert CKPT --to-hf HF_DIR",
    "--max-batches": "--eval-steps",
    "--input-ids": "logits of given ids are megapar-eval's (megapar-eval --load CKPT "
    "--input-ids IDS.npy --save-logits OUT.npy); drop it",
    # names common to many training scripts, which the closest spelling matches to the wrong
    # setting (max_lr to min_lr, save_dir to save_interval)
    "--max-lr": "--lr (the peak learning rate, which warmup reaches)",
    "--peak-lr": "--lr (the peak learning rate, which warmup reaches)",
    "--min-learning-rate": "--min-lr",
    "--lr-schedule": "--lr-decay (the learning rate's schedule; --schedule is the pipeline's)",
    "--save-dir": "--save",
    "--checkpoint-dir": "--save",
    "--log-every": "--log-interval",
    "--checkpoint-every": "--save-interval",
    "--eval-batch-size": "megapar-train evaluates --eval-steps global batches of "
    "--global-batch-size sequences: no batch size of its own",
}
"""Megatron-LM's, torchtitan's, DeepSpeed's and Hugging Face Trainer's names for megapar-train's
flags: an unknown flag that is one of them is answered with megapar's (difflib would name an
unrelated flag: `--resume`: `--recompute`, `--train-iters`: `--rank-order`, `--data-path`:
`--data-cache`, `--hidden-size`: `--world-size`, `--no-load-optim`: `--no-offload-optimizer`);
a model's size (`--num-layers`) is the --model config's; a sentence says what to do where
megapar has no such flag, and an empty entry names nothing."""


MEGATRON_MARKS = frozenset(
    {
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
        "--expert-model-parallel-size",
        "--num-layers",
        "--num-attention-heads",
        "--ffn-hidden-size",
        "--seq-length",
        "--max-position-embeddings",
        "--train-iters",
        "--train-samples",
        "--lr-decay-style",
        "--lr-decay-iters",
        "--lr-warmup-iters",
        "--lr-warmup-fraction",
        "--use-distributed-optimizer",
        "--data-path",
        "--vocab-file",
        "--merge-file",
        "--tokenizer-type",
        "--split",
        "--eval-iters",
        "--recompute-granularity",
        "--recompute-method",
        "--recompute-activations",
        "--use-mcore-models",
        "--transformer-impl",
        "--num-query-groups",
        "--group-query-attention",
        "--kv-channels",
        "--normalization",
        "--swiglu",
        "--position-embedding-type",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--virtual-pipeline-model-parallel-size",
        "--num-layers-per-virtual-pipeline-stage",
        "--num-virtual-stages-per-pipeline-rank",
    }
)
"""Flags of Megatron-LM's pretrain_gpt.py that no other trainer spells so: one among a line's
unknown flags marks a Megatron-LM command (`megatron_defaults`). (--bf16 and --fp16 are the
Hugging Face Trainer's and DeepSpeed's too: alone they mark none.)"""


CONSTANT_READS_NO = "which reads no --min-lr or --lr-decay-steps: drop those"
"""What an answer of --lr-decay constant adds: the decay's flags given beside it would be
refused next."""

OFF_VALUES = {
    "--clip-grad": "0",
    "--weight-decay": "0",
    "--warmup-steps": "0",
    "--eval-interval": "0",
    "--lr-decay": "constant",
    "--precision": "fp32",
}
"""megapar-train's flags on by default and the value that turns each off: what another tool's
switch answered by one is told to give for false (`--no-grad-clip`: --clip-grad 0), and the
flag's own --no- spelling (`--no-weight-decay`), which is no flag."""

FALSE_ANSWERS = {
    "bf16": "false asks for no bf16: {drop} (fp32 is megapar-train's default "
    "--precision; true would be --precision bf16)",
    "fp16": "false asks for no fp16: {drop} (fp32 is megapar-train's default "
    "--precision; true would be --precision fp16)",
    "use_tp_pp_dp_mapping": "false is Megatron-LM's default rank order, tp-cp-ep-dp-pp: "
    "--rank-order tp-dp-pp (megapar's default is tp-pp-dp)",
    "decay_lr": "false asks for a constant learning rate: --lr-decay constant (megapar-train "
    f"decays it by default, --lr-decay cosine), {CONSTANT_READS_NO}",
    "dynamic_loss_scale": "false asks for a static fp16 loss scale: --loss-scale S (megapar's "
    "is dynamic without it)",
    "mock_data": "false asks for your corpus: --data PATH (without it megapar-train trains on "
    "its shipped Shakespeare sample)",
    "eval_only": "false is a training run, megapar-train's: {drop}",
    "disable_tqdm": "false shows the progress bar: --progress (not given, megapar-train shows it "
    "at a terminal only)",
    "do_eval": "false asks for no evaluation: --eval-interval 0",
    "eval": "false asks for no evaluation: --eval-interval 0",
    "accumulate_allreduce_grads_in_fp32": "false reduces the gradients in the 16-bit dtype: "
    "--grad-reduce-dtype bf16 (fp16 under --precision fp16; megapar-train's default, auto, "
    "reduces them in fp32 under bf16)",
}
"""What another tool's switch given as false (in a --config file or on the command line) asks
of megapar-train, for the switches whose false is not megapar-train's default (each line names
the flag; `{drop}`: how the setting is left out, `false_answer`'s `drop`); `false_answer`
answers the other false ones."""

TRUE_ANSWERS = {
    "decay_lr": "true is megapar-train's default: it decays the learning rate (--lr-decay "
    "cosine); {drop}",
}
"""Another tool's switches given as true (in a --config file or on the command line) whose
answer, `other_tools_answer`, leads with what false asks for (`{drop}` as in `FALSE_ANSWERS`)."""


def false_answer(
    key: str, other: str, off_by_default: Callable[[str], bool], drop: str = "remove the key"
) -> str | None:
    """The answer to another tool's switch `key` given as false in a --config file (or on the
    command line, `drop` then "leave the flag out"): its `FALSE_ANSWERS` line; where `other`
    (its answer as true) names a megapar-train flag that is off by default (`off_by_default`
    of its name: a switch, --recompute none, --zero 0), that false is megapar-train's default,
    the setting to leave out (gradient_checkpointing: false was told 'did you mean --recompute
    full?'); where it names one on by default that a value turns off (`OFF_VALUES`: grad_clip),
    that value; None: `other` (a sentence on what megapar does)."""
    if key in FALSE_ANSWERS:
        return FALSE_ANSWERS[key].format(drop=drop)
    if other.split()[0] in OFF_VALUES:  # --no-grad-clip (it had no answer)
        flag = other.split()[0]
        return f"false turns it off: {flag} {OFF_VALUES[flag]}" + (
            f", {CONSTANT_READS_NO}" if flag == "--lr-decay" else ""
        )
    if other.startswith("--") and off_by_default(other.split()[0]):
        return (
            f"false leaves it off, as megapar-train does by default: {drop} (true would be {other})"
        )
    return None


def answers_a_switch(key: str, is_switch: Callable[[str], bool]) -> bool:
    """Whether another tool's setting `key` is a switch (so that 0 / 1 given to it are false /
    true, not numbers): one `FALSE_ANSWERS` / `TRUE_ANSWERS` holds, or one whose answer names a
    megapar-train switch alone (`is_switch`: --compile) or a flag with the value it stands for
    (--recompute full, --precision bf16), not a flag whose value it leaves to the user
    (--loss-scale (a static scale ...), --data PATH)."""
    key = key.replace("-", "_")
    if key in FALSE_ANSWERS or key in TRUE_ANSWERS:
        return True
    words = (other_tools_answer(key) or "").split()
    if not words or not words[0].startswith("--"):
        return False
    if len(words) == 1 or words[1].startswith("("):
        return is_switch(words[0])
    return not words[1].isupper() and not words[1].startswith("-")


REPORT_KEYS = frozenset({"report_to", "log_with"})
"""Other tools' settings naming where a run reports (the Trainer's report_to, accelerate's
log_with), whose "none" reports nowhere."""


def reports_nowhere(key: str, value: Any, drop: str = "remove the key") -> str | None:
    """The answer to `REPORT_KEYS`' "none" (or an empty list): megapar-train's default;
    None for another key or value (--report_to none was told --wandb-project NAME or
    --tensorboard DIR; a re-test)."""
    empty = value == [] or (isinstance(value, str) and value.strip().lower() in ("none", "[]"))
    if key.replace("-", "_") not in REPORT_KEYS or not empty:
        return None
    return (
        f"none reports nowhere, as megapar-train does without --wandb-project or "
        f"--tensorboard: {drop}"
    )


def switch_answer(
    key: str, value: bool, off_by_default: Callable[[str], bool], drop: str = "remove the key"
) -> str | None:
    """The answer to another tool's switch `key` (`decay_lr`, `gradient-checkpointing`) given
    as `value` where it differs from what `other_tools_answer` says (true asks for), as
    `false_answer` and `TRUE_ANSWERS` say; None where that answer holds, or `key` is no
    other tool's."""
    key = key.replace("-", "_")
    other = other_tools_answer(key)
    if not other:
        return None
    if value is False:
        return false_answer(key, other, off_by_default, drop)
    return TRUE_ANSWERS[key].format(drop=drop) if key in TRUE_ANSWERS else None


def other_tools_answer(key: str) -> str | None:
    """`OTHER_TOOLS_FLAGS`' answer for another tool's setting `key` as a config key or keyword
    names it (`grad_accum_steps`, `max_norm`): its dashed flag's, its own spelling's, or the one
    dotted key it ends (`key_without_section`: torchtitan's `training.max_norm`); None."""
    other = OTHER_TOOLS_FLAGS.get("--" + key.replace("_", "-"), OTHER_TOOLS_FLAGS.get("--" + key))
    if not other and (dotted := key_without_section(OTHER_TOOLS_FLAGS, "--" + key)):
        other = OTHER_TOOLS_FLAGS[dotted]
    return other


def megatron_defaults(unknown: list[str], given: set[str]) -> str:
    """For a command line whose `unknown` flags mark it as Megatron-LM's, megapar-train's
    defaults that are not Megatron-LM's (its `arguments.py` and training config), to give where
    the run should be Megatron-LM's: each unless the line `given` sets it in either tool's
    name, and fp16's loss scaler only where `--fp16` is among them; "" for any other line."""
    if not MEGATRON_MARKS & set(unknown):
        return ""
    defaults = [  # (the flags that set it, in megapar's and Megatron-LM's names; what differs)
        (
            ("--weight-decay", "--start-weight-decay", "--end-weight-decay"),
            "--weight-decay 0.1 (Megatron-LM's 0.01)",
        ),
        (
            ("--global-batch-size",),
            "--global-batch-size 16, a multiple of --micro-batch-size x dp (--micro-batch-size "
            "x dp: no accumulation)",
        ),
        (("--adam-beta2",), "--adam-beta2 0.95 (0.999)"),
        (("--lr-decay", "--lr-decay-style"), "--lr-decay cosine (linear)"),
        (
            ("--warmup-steps", "--lr-warmup-iters", "--lr-warmup-fraction", "--lr-warmup-samples"),
            "--warmup-steps 20, at most 10 % of the steps (0)",
        ),
        (("--min-lr",), "--min-lr 1e-4, at most --lr x 0.1 (0)"),
    ]
    if "--fp16" in unknown:
        defaults += [
            (("--initial-loss-scale",), "--initial-loss-scale 65536 (2^32)"),
            (("--hysteresis",), "--hysteresis 1 (2)"),
        ]
    differ = [said for flags, said in defaults if not given & set(flags)]
    if not differ:
        return ""
    return (
        "megapar-train's defaults that are not Megatron-LM's: "
        + ", ".join(differ)
        + "; give Megatron-LM's where the run should be its"
    )
