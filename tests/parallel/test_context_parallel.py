"""Context parallelism's parts: the load-balanced layout, splitting a batch, the mask-free causal kernel of each device
(its merge and backward against plain causal attention, the CUDA kernels' plumbing on stand-ins and meta tensors), K
and V in flight together, attention over the gathered keys and values against one device (several processes), the
all-to-all modes (Ulysses, hierarchical) against one device with every rank a thread of this process, packed
documents (numbered before the split, their masks in every mode, whole models against one device, the load
balance of the zig-zag chunks on llama_sft's packed rows), and the start-up refusals with their arithmetic."""

from __future__ import annotations

import copy
import dataclasses
import json
import threading

import pytest
import torch
import torch.nn.functional as F

import launch
from dufu.data.sft import build_sft_datasets
from dufu.data.tokenizer import build_tokenizer
from dufu.engine.preflight import preflight
from dufu.errors import LayoutError
from dufu.layers.attention import document_mask
from dufu.models.gpt.model import GPTModel
from dufu.models.llama import LlamaModel
from dufu.parallel import context_parallel
from dufu.parallel.context_kernels import CPU_FLASH, CUDA_EFFICIENT, CUDA_FLASH, _CausalChunks, causal_kernel
from dufu.parallel.context_parallel import ContextParallel, apply_context_parallel, document_keep, document_numbers
from dufu.parallel.parallel_dims import ParallelDims
from dufu_testing import load_config

CP = "train.dist.context_parallel_size"
SDPA = F.scaled_dot_product_attention  # the reference, kept where a test takes the masked path away


def test_each_rank_holds_chunk_r_and_its_mirror():
    """T = 8 over cp 2: chunks of 2, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (balanced causal work)."""
    cps = [ContextParallel(None, 2, r) for r in range(2)]
    assert cps[0].token_index(8).tolist() == [0, 1, 6, 7]
    assert cps[1].token_index(8).tolist() == [2, 3, 4, 5]
    four = [ContextParallel(None, 4, r).token_index(16).tolist() for r in range(4)]
    assert four[0] == [0, 1, 14, 15] and four[3] == [6, 7, 8, 9]
    assert sorted(sum(four, [])) == list(range(16))
    # every rank attends to 2 cp + 1 chunks of keys under a causal mask
    assert {sum(a + 1 for a in ContextParallel(None, 4, r).chunk_ids()) for r in range(4)} == {9}


def test_gather_puts_every_ranks_tokens_back_in_sequence_order():
    T = 16
    x = torch.arange(T).float()[None, :, None]  # (1, T, 1): each token its position
    shards = [x[:, ContextParallel(None, 4, r).token_index(T)] for r in range(4)]
    cp = ContextParallel(None, 4, 1, gather=lambda t, dim: torch.cat(shards, dim))
    assert cp.gather(shards[1], 1).flatten().tolist() == list(range(T))


def test_shard_batch_splits_every_token_tensor_and_adds_global_positions():
    cp = ContextParallel(None, 2, 1)
    ids = torch.arange(16).view(2, 8)
    out = cp.shard_batch({"input_ids": ids, "shift_labels": ids + 100, "attention_mask": torch.ones(2, 8)})
    assert out["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert out["shift_labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert out["position_ids"].tolist() == [[2, 3, 4, 5]] * 2 and out["attention_mask"].shape == (2, 4)
    # a model's own positions (RoBERTa counts from pad_token_id + 1) are computed on the whole sequence
    cp.positions = lambda input_ids: torch.arange(input_ids.shape[1])[None] + 2
    assert cp.shard_batch({"input_ids": ids})["position_ids"].tolist() == [[4, 5, 6, 7]] * 2


@pytest.mark.parametrize("inputs, fragment", [
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long)},
     "sequence-classification"),
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "position_ids": torch.zeros(1, 6, dtype=torch.long)},
     "position_ids of shape (B|1, 8)"),
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "position_ids": torch.zeros(1, 8, dtype=torch.long),
      "attention_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool)}, "a (2, 8) padding mask only"),
    ({"pixel_values": torch.zeros(2, 3, 8, 8)}, "no (B, T) input_ids"),
])
def test_batches_context_parallelism_cannot_split_are_refused(inputs, fragment):
    with pytest.raises(ValueError, match="context") as info:
        ContextParallel(None, 2, 0).shard_batch(inputs)
    assert fragment in str(info.value)


def test_shard_batch_numbers_documents_on_the_whole_rows_before_the_split():
    """Packed rows: the data's position ids (restarting at each document) are kept and cut, and the documents,
    numbered on the whole row (a rank could not tell that its token 6 starts a document), travel as the
    attention_mask; rows of one document each keep the plain causal path (no mask)."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 0, 1]])
    ids = torch.arange(16).view(2, 8)
    got = [ContextParallel(None, 2, r).shard_batch({"input_ids": ids, "position_ids": positions}) for r in range(2)]
    assert got[0]["position_ids"].tolist() == [[0, 1, 3, 0], [0, 1, 0, 1]]  # tokens 0 1 6 7
    assert got[1]["position_ids"].tolist() == [[2, 0, 1, 2], [2, 3, 4, 5]]  # tokens 2 3 4 5
    assert got[0]["attention_mask"].tolist() == [[1, 1, 2, 3], [1, 1, 2, 2]]
    assert got[1]["attention_mask"].tolist() == [[1, 2, 2, 2], [1, 1, 1, 1]]
    one_each = ContextParallel(None, 2, 0).shard_batch({"input_ids": ids, "position_ids": torch.arange(8)[None] + 3})
    assert "attention_mask" not in one_each and one_each["position_ids"].tolist() == [[3, 4, 9, 10]] * 2
    padded = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1], [1] * 8])  # token 3 padding inside document 1 of row 0
    got = ContextParallel(None, 2, 1).shard_batch({"input_ids": ids, "position_ids": positions,
                                                   "attention_mask": padded})
    assert got["attention_mask"].tolist() == [[1, -1, 2, 2], [1, 1, 1, 1]]


def test_document_numbers_give_one_devices_document_mask():
    """The numbers' mask (causal, document_keep) equals dufu.layers.attention.document_mask wherever that builds
    one: random packed rows, with and without padding (inside documents, leading, trailing)."""
    g = torch.Generator().manual_seed(0)
    T = 24
    for trial in range(20):
        rows = []
        for _ in range(3):
            cuts = sorted(torch.randperm(T - 1, generator=g)[:int(torch.randint(1, 5, (1,), generator=g))] + 1)
            edges = [0, *[int(c) for c in cuts], T]
            rows.append(torch.cat([torch.arange(b - a) + (0 if i else 2) for i, (a, b) in
                                   enumerate(zip(edges, edges[1:]))]))
        positions = torch.stack(rows)
        padding = (torch.rand(3, T, generator=g) > 0.2).long() if trial % 2 else None
        expected = document_mask(positions, padding)
        docs = document_numbers(positions, padding)
        if docs is None:
            assert not (torch.is_tensor(expected) and expected.dim() == 4)
            continue
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        assert torch.equal(causal & document_keep(docs[:, None, :, None], docs[:, None, None, :]), expected)


def test_an_all_to_all_groups_queries_are_its_members_chunks_in_member_order():
    """cp 4: hierarchical groups of 2 (cp ranks [0,1] and [2,3]) attend for chunks (0, 7, 1, 6) and (2, 5, 3, 4);
    Ulysses' one group for every chunk, in rank order (which global_order puts in sequence order)."""
    assert [ContextParallel(None, 4, r, a2a_size=2).query_chunk_ids() for r in range(4)] == \
        [(0, 7, 1, 6)] * 2 + [(2, 5, 3, 4)] * 2
    ulysses = ContextParallel(None, 4, 3, a2a_size=4)
    assert ulysses.query_chunk_ids() == (0, 7, 1, 6, 2, 5, 3, 4)
    T = 16
    assert ulysses.rank_order(T)[ulysses.global_order(T)].tolist() == list(range(T))
    with pytest.raises(ValueError, match="a2a_size 3 ranks, which must divide the context-parallel size 4"):
        ContextParallel(None, 4, 0, a2a_size=3)


def test_the_world_is_dp_x_cp_x_tp_x_pp():
    dims = ParallelDims(2, 2, 1, 8, context_parallel_size=2)
    assert dims.data_axis_size == 4 and dims.describe().startswith("dp 2 x cp 2 x tp 2 x pp 1 = 8")
    assert ParallelDims(-1, 1, 1, 8, context_parallel_size=4).data_parallel_size == 2
    with pytest.raises(LayoutError, match=r"dp 1 x cp 2 x tp 1 x pp 1 = 2, but WORLD_SIZE is 4"):
        ParallelDims(1, 1, 1, 4, context_parallel_size=2)
    with pytest.raises(LayoutError, match="not supported together"):
        ParallelDims(2, 1, 1, 4, expert_parallel_size=2, context_parallel_size=2)
    hier = ParallelDims(1, 1, 1, 8, context_parallel_size=8, context_parallel_mode="hierarchical",
                        context_parallel_a2a_size=2)
    assert hier.context_a2a_size == 2 and "all-to-all within 2, all-gather across 4" in hier.describe()
    assert ParallelDims(1, 1, 1, 4, context_parallel_size=4, context_parallel_mode="all_to_all").context_a2a_size == 4
    assert ParallelDims(4, 1, 1, 4, context_parallel_mode="all_to_all").context_a2a_size == 1  # no cp: no exchange
    with pytest.raises(LayoutError, match="context_parallel_mode = 'ring' is not known"):
        ParallelDims(1, 1, 1, 2, context_parallel_size=2, context_parallel_mode="ring")
    hsdp = ParallelDims(2, 1, 1, 4, context_parallel_size=2, data_parallel_replicate_size=2)
    assert hsdp.data_shard_size == 2 and "2 replicas x 2 shards" in hsdp.describe()  # a replica: the cp pair
    with pytest.raises(LayoutError, match="hybrid sharding and expert parallelism are not supported together"):
        ParallelDims(4, 1, 1, 4, expert_parallel_size=2, data_parallel_replicate_size=2)


class ThreadedRanks:
    """Ranks as threads of this process, for a test: stand-ins of the functional collectives that exchange the
    tensors of the threads named by a group (a tuple of cp ranks), so that the all-to-all modes run their real
    code, forward and backward, on every rank at once."""

    def __init__(self):
        self.cond, self.slots, self.local = threading.Condition(), {}, threading.local()

    def _exchange(self, group, x) -> list:
        me, count = self.local.rank, self.local.calls
        key = (group, count.get(group, 0))
        count[group] = key[1] + 1
        with self.cond:
            self.slots.setdefault(key, {})[me] = x.detach().clone()
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: len(self.slots[key]) == len(group), timeout=60), f"{key} hangs"
        return [self.slots[key][r] for r in group]

    def all_to_all(self, x, output_split_sizes, input_split_sizes, group):
        assert output_split_sizes is None and input_split_sizes is None
        i, parts = group.index(self.local.rank), self._exchange(group, x)
        return torch.cat([p.chunk(len(group), 0)[i] for p in parts], 0)

    def all_gather(self, x, dim, group):
        return torch.cat(self._exchange(group, x), dim)

    def reduce_scatter(self, g, op, dim, group):
        assert op == "sum"
        return sum(self._exchange(group, g)).chunk(len(group), dim)[group.index(self.local.rank)]

    def run(self, size: int, fn) -> list:
        """``fn(rank)`` on ``size`` threads at once -> their results in rank order (a failure re-raised)."""
        results, errors = [None] * size, []

        def body(rank):
            self.local.rank, self.local.calls = rank, {}
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(e)
                with self.cond:
                    self.cond.notify_all()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def threaded_context_parallel(size: int, rank: int, a2a_size: int) -> ContextParallel:
    """Rank ``rank``'s ContextParallel with groups as ThreadedRanks names them."""
    first = rank // a2a_size * a2a_size
    inner = tuple(range(first, first + a2a_size))
    outer = tuple(range(rank % a2a_size, size, a2a_size))
    return ContextParallel(tuple(range(size)), size, rank, a2a_size=a2a_size, a2a_group=inner, gather_group=outer)


# id: (cp, a2a size, causal, query heads, key/value heads, mask kind, bias per head)
EXCHANGES = {
    "ulysses-cp2": (2, 2, True, 4, 4, None),
    "ulysses-cp4-gqa-kv-repeated": (4, 4, True, 4, 2, None),
    "ulysses-cp4-padding": (4, 4, True, 8, 2, "padding"),
    "ulysses-cp2-bidirectional-bias-per-head": (2, 2, False, 4, 4, "head-bias"),
    "hierarchical-2x2": (4, 2, True, 4, 2, None),
    "hierarchical-2x2-kv-repeated": (4, 2, True, 4, 1, None),
    "hierarchical-2x2-padding": (4, 2, True, 4, 2, "padding"),
    "hierarchical-2x2-bidirectional-padding": (4, 2, False, 4, 4, "padding"),
    "all-gather-cp4": (4, 1, True, 4, 2, None),
    "all-gather-cp2-documents": (2, 1, True, 4, 2, "documents"),
    "all-gather-cp4-documents-padding": (4, 1, True, 4, 4, "documents-padding"),
    "ulysses-cp2-documents": (2, 2, True, 4, 2, "documents"),
    "ulysses-cp4-documents-padding": (4, 4, True, 4, 1, "documents-padding"),
    "hierarchical-2x2-documents": (4, 2, True, 4, 2, "documents"),
}


def packed_positions(B: int, T: int) -> torch.Tensor:
    """(B, T) position ids of packed rows: row 0 documents of 3, 5 (ending at a chunk's end for chunks of 4) and
    T - 8 tokens; row 1 a one-token document, T - 2, and one token (a break at every rank)."""
    rows = [[3, 5, T - 8], [1, T - 2, 1]]
    return torch.stack([torch.cat([torch.arange(n) for n in rows[b % 2]]) for b in range(B)])


@pytest.mark.parametrize("case", list(EXCHANGES))
def test_all_to_all_modes_equal_one_device(case, monkeypatch):
    """Outputs and q/k/v gradients of every rank's attention (the all-to-alls, the repeat of key/value heads, the
    permutations to and from sequence order, the hierarchical K/V all-gather, masks and biases) against one
    device's SDPA, in fp64: only the order of sums differs, so 1e-12."""
    cp, A, causal, nh, nkv, kind = EXCHANGES[case]
    ranks = ThreadedRanks()
    monkeypatch.setattr(context_parallel, "_all_to_all", ranks.all_to_all)
    monkeypatch.setattr(context_parallel, "_all_gather", ranks.all_gather)
    monkeypatch.setattr(context_parallel, "_reduce_scatter", ranks.reduce_scatter)
    torch.manual_seed(0)
    B, T, hs = 2, 8 * cp, 8
    q = torch.randn(B, nh, T, hs, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, nkv, T, hs, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(B, nh, T, hs, dtype=torch.float64)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[0, -5:] = False  # right padding across the last chunks (causal left padding leaves a query no key)
    if not causal:
        keep[1, :3] = False
    mask = None
    if kind == "padding":
        mask = keep.long()  # (B, T) as the model gives it
        ref_mask = keep[:, None, None, :] & (torch.ones(T, T, dtype=torch.bool).tril() if causal else True)
    elif kind == "head-bias":
        mask = torch.randn(1, nh, 1, T, dtype=torch.float64)  # additive, one row per head
        ref_mask = mask
    elif kind is not None:  # packed documents: numbered on the whole rows, as shard_batch does
        positions, padding = packed_positions(B, T), (keep.long() if kind == "documents-padding" else None)
        mask = document_numbers(positions, padding)  # (B, T)
        ref_mask = document_mask(positions, padding)  # (B, 1, T, T), one device's
        assert mask is not None and ref_mask.shape == (B, 1, T, T)
    gqa = nkv != nh
    if mask is None:
        ref = SDPA(q, k, v, is_causal=causal, enable_gqa=gqa)
    else:
        ref = SDPA(q, k, v, attn_mask=ref_mask, enable_gqa=gqa)
    expected = (ref, *torch.autograd.grad((ref * w).sum(), (q, k, v)))

    def rank_step(rank):
        cpr = threaded_context_parallel(cp, rank, A)
        own = cpr.token_index(T)
        local_mask = None if mask is None else mask.index_select(mask.dim() - 1, own)
        y = cpr.attention(q[:, :, own], k[:, :, own], v[:, :, own], local_mask, causal, None, 0.0, gqa)
        return own, y.detach(), torch.autograd.grad((y * w[:, :, own]).sum(), (q, k, v))

    ys, grads = torch.zeros_like(ref), [torch.zeros_like(t) for t in (q, k, v)]
    for own, y, g in ranks.run(cp, rank_step):
        ys[:, :, own] = y
        grads = [a + b for a, b in zip(grads, g)]
    for name, a, b in zip(("output", "dq", "dk", "dv"), expected, (ys, *grads)):
        assert (a - b).abs().max().item() < 1e-12, f"{case}: {name}"


# id: (recipe, world size, overrides, fragments of the message)
REFUSALS = {
    "seq-not-divisible": ("gpt_debug", 3, [f"{CP}=3"],
                          ["2 x cp = 6 chunks", "seq_length 32 / 6 = 5.33333 is not whole", "(nearest: 30 or 36)"]),
    "t5": ("t5_debug", 2, [f"{CP}=2"], ["T5ForConditionalGeneration cannot be split by context parallelism",
                                          "cross-attention", "context_parallel_size=1"]),
    "vit": ("vit_debug", 2, [f"{CP}=2"], ["ViTForImageClassification cannot be split", "[CLS]"]),
    "swin": ("swin_debug", 2, [f"{CP}=2"], ["SwinForImageClassification cannot be split", "windows"]),
    "classification": ("bert_classify_debug", 2, [f"{CP}=2"], ["BertForSequenceClassification cannot be split"]),
    "moe": ("moe_debug", 2, [f"{CP}=2"], ["MoEModel cannot be split", "load-balancing loss"]),
    "product": ("gpt_debug", 2, [f"{CP}=2", "train.dist.data_parallel_size=2"],
                ["dp 2 x cp 2 x tp 1 x pp 1 = 4", "WORLD_SIZE is 2"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_layouts_context_parallelism_cannot_take_fail_at_preflight(case, tmp_path):
    recipe, world, overrides, fragments = REFUSALS[case]
    cfg = load_config(recipe, [*overrides, f"train.output_dir={tmp_path / 'run'}"])
    with pytest.raises(LayoutError) as info:
        preflight(cfg, world_size=world)
    message = " ".join(str(info.value).split())
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("recipe, cp, mode", [("llama_debug", 2, []),
                                              ("llama_debug", 2, ["train.dist.context_parallel_mode=all_to_all"]),
                                              ("gpt_debug", 4, ["train.dist.context_parallel_mode=hierarchical",
                                                                "train.dist.context_parallel_a2a_size=2"])])
def test_document_masks_pass_preflight_under_context_parallelism(recipe, cp, mode, tmp_path):
    """Documents (and packed samples: the same position ids) are no longer refused with context parallelism,
    in any mode."""
    cfg = load_config(recipe, [f"{CP}={cp}", "dataloader.train.document_mask=True", *mode,
                               f"train.output_dir={tmp_path / 'run'}"])
    preflight(cfg, world_size=cp)


@pytest.mark.multiprocess
def test_attention_over_chunks_equals_one_device(tmp_path, nproc=4):
    """Outputs, input gradients and weight gradients of one attention layer: causal, grouped-query, padded,
    bidirectional with a padding mask or a bias (tests/parallel/context_parallel_worker.py)."""
    worker = launch.REPO / "tests" / "parallel" / "context_parallel_worker.py"
    proc = launch.run(launch.torchrun_command(worker, nproc, tmp_path), output_dir=tmp_path, timeout=300)
    launch.assert_ok(proc)
    for rank, worst in enumerate(json.loads((tmp_path / "errors.json").read_text())):
        for case, err in worst.items():
            assert err < 1e-5, f"cp{nproc} rank {rank} {case}: largest error {err}"


# ------------------------------------------------------------------------------------- the mask-free causal kernel
def test_each_device_and_dtype_gets_its_kernel():
    assert causal_kernel("cpu", torch.float32) is CPU_FLASH and causal_kernel("cpu", torch.bfloat16) is CPU_FLASH
    assert causal_kernel("cuda", torch.bfloat16) is CUDA_FLASH and causal_kernel("cuda", torch.float16) is CUDA_FLASH
    assert causal_kernel("cuda", torch.float32) is CUDA_EFFICIENT  # FlashAttention takes half precision only
    assert causal_kernel("mps", torch.float32) is None and causal_kernel("xpu", torch.bfloat16) is None
    for kernel in (CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT):  # every op exists in this build's aten
        assert kernel.op(kernel.forward_op) is not None and kernel.op(kernel.backward_op) is not None


def one_rank_of_two(q, k, v, rank, **kw):
    """Rank ``rank``'s attention of cp 2 over the whole (B, nh, T, hs) q, k, v: its tokens cut out, the all-gather
    stood in for by the whole tensors' tokens in rank order (what the ranks' all-gather returns)."""
    T, whole = q.shape[2], {}
    cp = ContextParallel(None, 2, rank, gather=lambda x, dim: torch.cat(
        [whole[id(x)][:, :, ContextParallel(None, 2, r).token_index(T)] for r in range(2)], dim))
    own = cp.token_index(T)
    kr, vr = k[:, :, own], v[:, :, own]
    whole.update({id(kr): k, id(vr): v})
    return own, cp.attention(q[:, :, own], kr, vr, None, True, None, 0.0, **kw)


def causal_reference_and_split(dtype, kv_heads=4, kernel=None):
    """Outputs and q/k/v gradients of plain causal SDPA and of cp 2's two ranks (their losses summed, as the
    all-gather's backward sums them), for the same loss sum(y * w). ``kernel``: run _CausalChunks with it."""
    torch.manual_seed(0)
    B, nh, T, hs = 2, 4, 16, 8
    q = torch.randn(B, nh, T, hs, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, T, hs, dtype=dtype, requires_grad=True) for _ in range(2))
    w = torch.randn(B, nh, T, hs, dtype=dtype)
    gqa = kv_heads != nh
    ref = SDPA(q, k, v, is_causal=True, enable_gqa=gqa)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    ys, loss = torch.empty_like(ref), 0
    for rank in range(2):
        if kernel is None:
            own, y = one_rank_of_two(q, k, v, rank, enable_gqa=gqa)
        else:
            own = ContextParallel(None, 2, rank).token_index(T)
            y = _CausalChunks.apply(q[:, :, own], k, v, ContextParallel(None, 2, rank).chunk_ids(), None, kernel)
        ys[:, :, own] = y.detach()
        loss = loss + (y * w[:, :, own]).sum()
    return (ref.detach(), *ref_grads), (ys, *torch.autograd.grad(loss, (q, k, v)))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_mask_free_causal_chunks_equal_causal_attention(kv_heads, monkeypatch):
    """fp64, so that merging two partial softmaxes must agree with one softmax to 1e-12, and not by luck; the
    masked path (a mask per chunk and SDPA) is never taken."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", None)
    expected, got = causal_reference_and_split(torch.float64, kv_heads)
    for name, a, b in zip(("output", "dq", "dk", "dv"), expected, got):
        assert (a - b).abs().max().item() < 1e-12, name


def _cpu_standins():
    """Stand-ins with the CUDA ops' signatures and output layouts (checked against the real schemas by
    test_cuda_kernels_match_the_ops_schemas) that compute with the CPU kernel: the efficient kernel's stand-in pads
    its log-sum-exp to 32 rows with NaN, so a merge that read the padding would show."""
    cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    calls = []

    def flash(q, k, v, dropout_p, is_causal, return_debug_mask, scale=None):
        assert dropout_p == 0.0 and not return_debug_mask
        o, lse = cpu_fwd(q, k, v, dropout_p, is_causal, scale=scale)
        seed, offset = torch.tensor([len(calls), 0]), torch.tensor(0)
        calls.append(("flash", q.shape[2], k.shape[2], is_causal))
        return o, lse, None, None, q.shape[2], k.shape[2], seed, offset, torch.empty(0)

    def flash_backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset,
                       scale=None):
        assert (cum_q, cum_k, max_q, max_k) == (None, None, q.shape[2], k.shape[2]), "another call's state"
        assert calls[int(seed[0])] == ("flash", q.shape[2], k.shape[2], is_causal), "another call's RNG state"
        return cpu_bwd(grad, q, k, v, out, lse, dropout_p, is_causal, scale=scale)

    def efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale=None):
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0
        o, lse = cpu_fwd(q, k, v, dropout_p, is_causal, scale=scale)
        pad = -q.shape[2] % 32 or 32
        return o, F.pad(lse, (0, pad), value=float("nan")), torch.tensor(0), torch.tensor(0)

    def efficient_backward(grad, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal,
                           scale=None):
        assert attn_bias is None and list(grad_input_mask) == [True, True, True, False]
        assert lse.shape[-1] % 32 == 0 and lse.shape[-1] > q.shape[2], "the kernel's padded layout"
        return (*cpu_bwd(grad, q, k, v, out, lse[..., :q.shape[2]], dropout_p, is_causal, scale=scale), None)

    return (dataclasses.replace(CUDA_FLASH, forward_op=flash, backward_op=flash_backward),
            dataclasses.replace(CUDA_EFFICIENT, forward_op=efficient, backward_op=efficient_backward))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_route_runs_the_cpu_merge_and_backward(dtype):
    """The CUDA kernels' adapters, given stand-ins that compute with the CPU kernel, give the CPU route's outputs
    and gradients: the merge and the backward are one code, only the ops' plumbing differs. Flash bit for bit; the
    efficient kernel's log-sum-exp comes in another memory layout (padded rows), which moves elementwise results
    by an ulp or two (measured: 8e-8 of the largest value in fp32), where a read of its NaN padding would be NaN."""
    cpu = causal_reference_and_split(dtype, kernel=CPU_FLASH)[1]
    flash, efficient = _cpu_standins()
    for kernel, rel in ((flash, 0), (efficient, 1e-6)):
        got = causal_reference_and_split(dtype, kernel=kernel)[1]
        for name, a, b in zip(("output", "dq", "dk", "dv"), cpu, got):
            assert (a.float() - b.float()).abs().max().item() <= rel * a.float().abs().max().item(), \
                f"{kernel.name} {name}"
    expected = causal_reference_and_split(dtype, kernel=CPU_FLASH)[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # relative to the largest value; bf16 keeps 8 bits
    for name, a, b in zip(("output", "dq", "dk", "dv"), expected, cpu):
        assert (a.float() - b.float()).abs().max().item() < tol * a.float().abs().max().item(), name


@pytest.mark.parametrize("kernel, dtype", [(CUDA_FLASH, torch.bfloat16), (CUDA_EFFICIENT, torch.float32)])
def test_cuda_kernels_match_the_ops_schemas(kernel, dtype):
    """The real CUDA ops, forward and backward, on meta tensors: torch parses every argument against the op's
    schema and its shape rules give the output and gradient shapes (the kernels themselves are unverified here)."""
    q = torch.randn(2, 4, 8, 16, dtype=dtype, device="meta", requires_grad=True)
    k, v = (torch.randn(2, 4, 16, 16, dtype=dtype, device="meta", requires_grad=True) for _ in range(2))
    y = _CausalChunks.apply(q, k, v, (1, 2), None, kernel)
    assert y.shape == q.shape and y.dtype == dtype
    dq, dk, dv = torch.autograd.grad(y.sum(), (q, k, v))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_a_gpus_checks_are_torchs_sdpa_params():
    """The GPU-side step-down asks torch's own dispatch checks; their argument list holds in this torch."""
    q = torch.randn(1, 2, 4, 8)
    params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, False, False)
    assert torch.backends.cuda.can_use_efficient_attention(params) in (True, False)


def test_k_and_v_are_both_in_flight_before_either_is_waited_for(monkeypatch):
    """The all-gathers of K and V are issued before the first wait, and so are the reduce-scatters of their
    gradients; the gathered values (the other rank's part stood in for by x + 100) and the gradients (the reduce
    of the two ranks' equal gradients: twice) are those of the collectives."""
    events = []

    class Pending:
        def __init__(self, name, value):
            self.name, self.value = name, value
            events.append(f"issue {name}")

        def wait(self):
            events.append(f"wait {self.name}")
            return self.value

    def all_gather(x, dim, group):
        assert dim == 0
        return Pending(f"gather {x.shape[-1]}", torch.cat([x, x + 100], dim))

    def reduce_scatter(g, op, dim, group):
        return Pending(f"reduce {g.shape[-1]}", 2 * g.narrow(dim, 0, g.shape[dim] // 2))

    monkeypatch.setattr(context_parallel, "_all_gather", all_gather)
    monkeypatch.setattr(context_parallel, "_reduce_scatter", reduce_scatter)
    k = torch.randn(1, 2, 4, 3, requires_grad=True)  # (B, nkv, T/cp, hs): K and V told apart by hs
    v = torch.randn(1, 2, 4, 5, requires_grad=True)
    gk, gv = context_parallel._GatherSequence.apply(2, None, k, v)
    assert events == ["issue gather 3", "issue gather 5", "wait gather 3", "wait gather 5"]
    assert torch.equal(gk, torch.cat([k, k + 100], 2)) and torch.equal(gv, torch.cat([v, v + 100], 2))
    events.clear()
    wk, wv = torch.randn(gk.shape), torch.randn(gv.shape)
    dk, dv = torch.autograd.grad((gk * wk).sum() + (gv * wv).sum(), (k, v))
    assert events == ["issue reduce 3", "issue reduce 5", "wait reduce 3", "wait reduce 5"]
    assert torch.equal(dk, 2 * wk[:, :, :4]) and torch.equal(dv, 2 * wv[:, :, :4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_kv_are_kept_unrepeated_with_the_numbers_of_repeating_outside(dtype):
    """4 query heads over 1 key/value head: what the backward keeps holds K and V as gathered, not repeated 4
    times, and outputs and gradients are bit for bit those of repeating K and V before the kernel (the CPU route
    as it was)."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 8, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 1, 16, 8, dtype=dtype, requires_grad=True) for _ in range(2))
    g = torch.randn(2, 4, 8, 8, dtype=dtype)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(tuple(t.shape)) or t, lambda t: t):
        y = _CausalChunks.apply(q, k, v, (1, 2), None, CPU_FLASH)
    assert kept.count((2, 1, 16, 8)) == 2 and (2, 4, 16, 8) not in kept
    kr, vr = (t.repeat_interleave(4, dim=1) for t in (k, v))
    y_out = _CausalChunks.apply(q, kr, vr, (1, 2), None, CPU_FLASH)
    assert torch.equal(y, y_out)
    for a, b in zip(torch.autograd.grad(y, (q, k, v), g), torch.autograd.grad(y_out, (q, k, v), g)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ packed documents
def tiny_model(family: str):
    """2 layers, hidden 64, vocab 256, fp64; LLaMA with rotary positions and grouped-query attention, GPT with
    learned positions."""
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaModel(256, hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           ffn_hidden_size=128, max_position_embeddings=64)
    else:
        model = GPTModel(256, hidden_size=64, num_layers=2, num_attention_heads=4, max_position_embeddings=64)
    for p in model.parameters():  # a spread of weights, so that a wrong mask or position moves the numbers
        p.data.normal_(0, 0.2)
    return model.double()


@pytest.mark.parametrize("family, a2a_size", [("llama", 1), ("llama", 2), ("gpt", 1)])
def test_packed_rows_train_as_on_one_device(family, a2a_size, monkeypatch):
    """A packed batch (documents cut at and between chunks, targets -100 at each document's end as packed SFT has
    them) through a whole model at cp 2, each rank a thread with its copy of the model: the logits (so every
    document's loss) and the summed weight gradients of the fp64 cross entropy equal one device's to 1e-10 (only
    the order of sums differs), and the model's own loss (fp32 cross entropy, each rank's mean weighted by its
    share of the targets as dufu.engine.global_loss does) to fp32's precision. All-gather and Ulysses."""
    ranks = ThreadedRanks()
    monkeypatch.setattr(context_parallel, "_all_to_all", ranks.all_to_all)
    monkeypatch.setattr(context_parallel, "_all_gather", ranks.all_gather)
    monkeypatch.setattr(context_parallel, "_reduce_scatter", ranks.reduce_scatter)
    model = tiny_model(family)
    B, T = 2, 32
    positions = packed_positions(B, T)
    ids = torch.randint(0, 256, (B, T))
    labels = torch.randint(0, 256, (B, T)).masked_fill(F.pad(positions[:, 1:] == 0, (0, 1), value=True), -100)
    total = (labels != -100).sum()

    def summed_loss(logits, targets):  # fp64 (the models' own loss is fp32): the sum over targets / all targets
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / total

    ref = model(input_ids=ids, position_ids=positions, shift_labels=labels)
    ref_grads = torch.autograd.grad(summed_loss(ref.logits, labels), list(model.parameters()))

    def rank_step(rank):
        cp = threaded_context_parallel(2, rank, a2a_size)
        part = apply_context_parallel(copy.deepcopy(model), cp)
        inputs = cp.shard_batch({"input_ids": ids, "position_ids": positions, "shift_labels": labels})
        out = part(**inputs)
        weighted = out.loss.detach() * (inputs["shift_labels"] != -100).sum() / total  # global_loss's weights
        grads = torch.autograd.grad(summed_loss(out.logits, inputs["shift_labels"]), list(part.parameters()))
        return cp.token_index(T), out.logits.detach(), weighted, grads

    logits, loss, grads = torch.zeros_like(ref.logits), 0, [torch.zeros_like(g) for g in ref_grads]
    for own, rank_logits, rank_loss, rank_grads in ranks.run(2, rank_step):
        logits[:, own] = rank_logits
        loss = loss + rank_loss
        grads = [a + b for a, b in zip(grads, rank_grads)]
    assert (logits - ref.logits).abs().max().item() < 1e-10
    assert abs(loss.item() - ref.loss.item()) < 1e-6 * ref.loss.item()
    for (name, _), a, b in zip(model.named_parameters(), ref_grads, grads):
        assert (a - b).abs().max().item() < 1e-10 * max(1.0, a.abs().max().item()), name
    # the documents matter: the same rows unpacked (positions 0 .. T-1) give other logits
    assert (model(input_ids=ids).logits - ref.logits).abs().max().item() > 1e-3


def document_work(positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(rows,) the causal work of the tokens ``index`` of packed rows: each token attends to the keys of its own
    document up to itself, position + 1 of them (packed positions count from 0 in every document)."""
    return (positions[:, index] + 1).double().sum(1)


def per_document_zig_zag_work(row: torch.Tensor, cp: int) -> torch.Tensor:
    """(cp,) the work of each rank if every document of ``row`` were cut into 2 cp zig-zag chunks of its own,
    padded to a multiple of 2 cp (Megatron's THD layout; the pads do no work)."""
    starts = [*(row == 0).nonzero().flatten().tolist(), len(row)]
    work = torch.zeros(cp, dtype=torch.float64)
    for a, b in zip(starts, starts[1:]):
        padded = -(-(b - a) // (2 * cp)) * 2 * cp
        w = F.pad(torch.arange(1, b - a + 1, dtype=torch.float64), (0, padded - (b - a)))
        chunks = w.view(2 * cp, -1).sum(1)
        work += torch.stack([chunks[r] + chunks[2 * cp - 1 - r] for r in range(cp)])
    return work


def test_zig_zag_chunks_balance_packed_documents_within_bounds():
    """The load balance of llama_sft's packed rows (the built-in pairs at seq_length 1024: 40 rows of 1-3 samples
    and a padding document) under the zig-zag chunks, as the module docstring reports it. The compute that runs
    (SDPA over each chunk's keys up to its end, masked, no block skipped) is the plain causal zig-zag's, 2 cp + 1
    chunk-blocks on every rank: balanced exactly. The document work (what a block-skipping kernel would do), the
    busiest rank against the mean: per row at cp 2 at worst 1.48 and on average 1.22 (a micro-batch of 2 rows:
    1.42, 1.21), at cp 4 2.12 and 1.53; cutting every document into zig-zag chunks of its own would give 1.01
    and 1.03 at worst (with up to 2 cp - 1 pads per document)."""
    train, _ = build_sft_datasets(build_tokenizer("byte"), seq_length=1024, packing=True)
    positions = torch.stack([torch.as_tensor(train[i]["position_ids"]) for i in range(len(train))])  # (40, 1024)
    assert positions.shape == (40, 1024) and 1 <= int((positions == 0).sum(1).min())
    measured = {}
    for cp in (2, 4):
        layouts = [ContextParallel(None, cp, r) for r in range(cp)]
        blocks = {sum(a + 1 for a in layout.chunk_ids()) for layout in layouts}
        assert blocks == {2 * cp + 1}  # what the masked path computes per rank, documents or not
        work = torch.stack([document_work(positions, layout.token_index(1024)) for layout in layouts], 1)
        row = work.max(1).values / work.mean(1)
        pairs = work.view(-1, 2, cp).sum(1)
        pair = pairs.max(1).values / pairs.mean(1)
        own = torch.stack([per_document_zig_zag_work(r, cp) for r in positions])
        measured.update({(cp, "row worst"): row.max().item(), (cp, "row mean"): row.mean().item(),
                         (cp, "pair worst"): pair.max().item(), (cp, "pair mean"): pair.mean().item(),
                         (cp, "per-document worst"): (own.max(1).values / own.mean(1)).max().item()})
    expected = {(2, "row worst"): 1.480, (2, "row mean"): 1.215, (2, "pair worst"): 1.419, (2, "pair mean"): 1.213,
                (2, "per-document worst"): 1.012, (4, "row worst"): 2.121, (4, "row mean"): 1.526,
                (4, "pair worst"): 1.957, (4, "pair mean"): 1.507, (4, "per-document worst"): 1.026}
    assert measured == pytest.approx(expected, abs=1e-3), measured
