"""parallelism.zero: ZeRO-1 (a full gradient buffer per rank, one reduce-scatter per step) matches one
rank as ZeRO-2 does (the other parity tests run ZeRO-2, the default), across microbatches, the
eager per-bucket reduce-scatter and the tied embedding's cross-stage sum."""
from parity_support import assert_parity, job


def test_zero1_parity_with_single_rank():
    assert_parity(job({"pp": 2, "dp": 2, "zero": 1}, tied=True, global_batch=4, overlap=True))


def test_one_dp_rank_accumulates_through_grad_views_and_steps_the_parameters_themselves():
    """dp 1 in fp32: `p.grad` are views of the gradient shard (no hook), the master weights are the parameters,
    and one step equals torch.optim.AdamW on the summed microbatch gradients."""
    import torch
    import torch.nn as nn

    from megascale.config import OptimizerConfig
    from megascale.parallel.topology import single_device_context
    from megascale.parallel.zero import DistributedOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3, bias=False))
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    cfg = OptimizerConfig(name="adamw", lr=1e-2, clip_grad=0.0)
    optimizer = DistributedOptimizer(list(model.named_parameters()), single_device_context(), cfg)
    assert optimizer.gradients._hooks == [] and optimizer.master.data_ptr() == optimizer.param_buffer.data_ptr()
    batches = [torch.randn(4, 6) for _ in range(3)]
    optimizer.begin_step(len(batches))
    for x in batches:
        model(x).square().mean().backward()
    for p in model.parameters():  # still views of the shard, holding the sum
        assert p.grad.untyped_storage().data_ptr() == optimizer.grad_shard.untyped_storage().data_ptr()
    optimizer.step(cfg.lr)

    def functional(x, w1, b1, g, b, w2):
        h = nn.functional.layer_norm(nn.functional.linear(x, w1, b1), (5,), g, b)
        return nn.functional.linear(h, w2)
    for x in batches:
        functional(x, *reference).square().mean().backward()
    decay = [{"params": [p for p in reference if p.dim() > 1]},
             {"params": [p for p in reference if p.dim() == 1], "weight_decay": 0.0}]
    expected = torch.optim.AdamW(decay, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    expected.step()
    for got, want in zip(model.parameters(), reference):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())  # zeroed for the next step


def test_buckets_default_to_about_eight_of_the_ranks_gradients_within_1_to_64_mb():
    """Several buckets, so the DP reduce-scatter of the first overlaps the rest of backward."""
    import torch
    import torch.nn as nn

    from megascale.config import OptimizerConfig
    from megascale.parallel.topology import single_device_context
    from megascale.parallel.zero import DistributedOptimizer, auto_bucket_numel

    def buckets(sizes: list[int], bucket_mb=None) -> int:
        params = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
        optimizer = DistributedOptimizer(params, single_device_context(), OptimizerConfig(), bucket_mb=bucket_mb)
        return len(optimizer.buckets)

    assert buckets([2**18] * 16) == 8  # 16 MB in 1 MB parameters: 2 MB buckets
    assert buckets([2**20] * 4) == 4  # 16 MB in 4 MB parameters: a parameter is a bucket's smallest unit
    assert buckets([1000] * 10) == 1  # under the 1 MB floor: one bucket
    assert buckets([2**18] * 16, bucket_mb=1.0) == 16  # a set size is kept
    huge = [nn.Parameter(torch.empty(2**28, device="meta")) for _ in range(10)]  # 10 GB of fp32 gradients
    assert auto_bucket_numel(huge) == 64 * 2**20 // 4  # at the 64 MB ceiling
