"""The megatron-core peer of `megascale bench peers`: GPTModel (local spec), its DDP, distributed optimizer
and pipeline schedules (interleaved when vpp > 1), run on CPU and gloo through the patches of
/work/shared/MEGATRON_CPU.md (numbered as there). They are applied inside bench rank processes only:
megascale itself never imports megatron.
"""
from __future__ import annotations

import time
import types
import warnings
from functools import partial

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megascale.bench.peers import mapped_weights, reference_state, source_of
from megascale.config import JobConfig
from megascale.parallel.topology import ParallelContext

# megascale GPT name -> GPTModel name, per layer (`{i}`: the global layer index) and outside the layers.
LAYER_NAMES = {
    "ln_1.weight": "input_layernorm.weight", "ln_1.bias": "input_layernorm.bias",
    "attn.qkv.weight": "self_attention.linear_qkv.weight", "attn.proj.weight": "self_attention.linear_proj.weight",
    "ln_2.weight": "pre_mlp_layernorm.weight", "ln_2.bias": "pre_mlp_layernorm.bias",
    "mlp.fc.weight": "mlp.linear_fc1.weight", "mlp.proj.weight": "mlp.linear_fc2.weight",
}
OUTER_NAMES = {"wte.weight": "embedding.word_embeddings.weight", "ln_f.weight": "decoder.final_layernorm.weight",
               "ln_f.bias": "decoder.final_layernorm.bias", "lm_head.weight": "output_layer.weight"}


def megatron_weights(state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """megascale's 1-rank GPT state dict in GPTModel's names and layouts, layers by global index. The fused
    QKV goes from [Q; K; V] to megatron's per-head [q0 k0 v0 q1 k1 v1 ...] (MHA: one k/v head per query head)."""

    def per_layer(layer: str, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if name == "attn.qkv.weight":
            hidden = t.shape[1]
            t = t.view(3, heads, hidden // heads, hidden).transpose(0, 1).reshape(3 * hidden, hidden)
        return {f"decoder.layers.{layer}.{LAYER_NAMES[name]}": t}

    return mapped_weights(state, OUTER_NAMES, per_layer)


class _CudaToCpu(TorchFunctionMode):
    """Patch 4: megatron's optimizer allocates on device='cuda', calls .cuda() and checks
    `param.type() == 'torch.cuda.FloatTensor'`; inside this mode those all mean the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: A002 - torch's signature
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_schedules_torch() -> types.ModuleType:
    """Patch 5, aimed at the schedules alone: their `torch` with `zeros(device='cuda')` on the CPU, so the
    whole forward-backward need not run under `_CudaToCpu` (15% slower on a tiny model)."""
    proxy = types.ModuleType("torch")
    proxy.__dict__.update(torch.__dict__)
    proxy.zeros = lambda *a, device=None, **k: torch.zeros(*a, **k)
    return proxy


def patch_for_cpu() -> None:
    """Patches 1-3 and 5-7. Called in a bench rank process (forked), never in megascale's own."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import torch_norm

    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # 1
    torch.cuda.manual_seed = lambda seed: None
    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.current_device = lambda: torch.device("cpu")  # 2
    fused_softmax.get_default_causal_mask = _cpu_causal_mask  # 3
    schedules.torch = _cpu_schedules_torch()  # 5
    torch.cuda.synchronize = lambda *a, **k: None  # 6
    original_new = torch_norm.WrappedTorchNorm.__new__

    def sequence_parallel_norm(cls, config, *args, **kwargs):  # 7: without the tag the numbers are wrong
        if not config.sequence_parallel:
            return original_new(cls, config, *args, **kwargs)
        norm = original_new(cls, types.SimpleNamespace(**{**vars(config), "sequence_parallel": False}), *args,
                            **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = sequence_parallel_norm


def transformer_config(cfg: JobConfig):
    """GPTModel options with megascale's gpt math: rotary, LayerNorm, tanh GeLU, no biases, untied, fp32."""
    from megatron.core.transformer import TransformerConfig

    m, p = cfg.model, cfg.parallelism
    return TransformerConfig(
        num_layers=m.layers, hidden_size=m.hidden, num_attention_heads=m.heads, ffn_hidden_size=m.ffn,
        normalization="LayerNorm", layernorm_epsilon=m.norm_eps, add_bias_linear=False,
        activation_func=partial(F.gelu, approximate="tanh"), bias_activation_fusion=False, gated_linear_unit=False,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=m.init_std, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp, sequence_parallel=p.sequence_parallel,
        virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
        batch_p2p_comm=False,  # pitfall 1: interleaved pp2 on gloo is silently wrong with batched p2p
    )


def _build_chunks(cfg: JobConfig, config, full: dict[str, torch.Tensor]) -> list[torch.nn.Module]:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tp_rank, vpp = parallel_state.get_tensor_model_parallel_rank(), cfg.parallelism.vpp
    chunks = []
    for v in range(vpp):
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=cfg.model.vocab, max_sequence_length=cfg.model.seq, pre_process=first,
                         post_process=last, share_embeddings_and_output_weights=False,
                         position_embedding_type="rope", rotary_base=int(cfg.model.rotary_base),
                         vp_stage=v if vpp > 1 else None)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.startswith("decoder.layers."):
                    _, _, local, rest = name.split(".", 3)
                    name = f"decoder.layers.{model.decoder.layers[int(local)].layer_number - 1}.{rest}"
                value = full[name]
                if getattr(param, "tensor_model_parallel", False):
                    value = value.chunk(cfg.parallelism.tp, dim=param.partition_dim)[tp_rank]
                param.copy_(value)
        chunks.append(model)
    return chunks


def train_megatron(ctx: ParallelContext, cfg: JobConfig, steps: int) -> dict:
    """Trains `steps` steps; returns this rank's step times and (last pipeline stage) losses."""
    # Without Transformer Engine and Apex megatron warns per module built that it falls back to torch's.
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # its deprecated calls
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    patch_for_cpu()
    p, m = cfg.parallelism, cfg.model
    if not torch.distributed.is_initialized():  # megascale starts no process group for 1 rank; megatron needs one
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(p.tp, p.pp, virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1
                                             else None)
    model_parallel_cuda_manual_seed(m.seed)
    config = transformer_config(cfg)
    raw = _build_chunks(cfg, config, megatron_weights(reference_state(cfg), m.heads))
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True)
    chunks = [DistributedDataParallel(config, ddp, c) for c in raw]
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.grad_sync_func = [c.start_grad_sync for c in chunks] if len(chunks) > 1 else chunks[0].start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    o = cfg.optimizer
    with _CudaToCpu():
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
            adam_eps=o.eps, clip_grad=o.clip_grad, use_distributed_optimizer=True, params_dtype=torch.float32),
            chunks)

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}  # pitfall 2: the schedule divides `loss` in place

    def forward_step(data, model):
        tokens, labels = next(data)
        return model(tokens, None, None, labels=labels), loss_func

    source, forward_backward = source_of(cfg, ctx), get_forward_backward_func()
    microbatches = cfg.batch.global_ // cfg.batch.micro // p.dp
    losses, times = [], []
    for _ in range(steps):
        started = time.perf_counter()
        tokens, labels = source.next_batch()
        batches = list(zip(tokens.chunk(microbatches), labels.chunk(microbatches)))
        for c in chunks:
            c.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
                               model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=microbatches,
                               seq_length=m.seq, micro_batch_size=cfg.batch.micro, forward_only=False)
        with _CudaToCpu():
            optimizer.step()
        times.append(time.perf_counter() - started)
        if out:
            losses.append(float(torch.stack([o["loss"] for o in out]).mean()))
    parallel_state.destroy_model_parallel()
    return {"losses": losses or None, "step_times": times}
