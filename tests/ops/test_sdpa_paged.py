"""Paged K/V with page ids outside the pools: a key whose id in the k table or the v table lies
outside [0, pages) is invisible, as if past seq_len_kv, in every kernel (prefill, decode, the
split decode and its combine) and in the reference. Each pool is a view of a buffer whose tail,
right after the pool, is a canary of NaN or huge values: an id that reached past the pool would
bring them into o. Ids past the pool, negative and at the int32 extremes, in the k table, the
v table or both, on a sequence's first, middle and last page."""
import pytest
import torch

import dnngraph as dg
from helpers import check, run

PAGES, KV_HEADS, PAGE, HEAD_DIM, HEADS = 19, 2, 8, 16, 4
PAGES_PER_SEQ = 6
SEQ_LENS = [45, 48, 17]  # a sequence's last page partly used or whole; 48 keys: 3 decode splits
BAD_IDS = [PAGES, PAGES + 1, -1, 2**31 - 1, -2**31]
CANARIES = {"nan": float("nan"), "huge": 3e38}


def pool_with_canary(generator, canary: float, device) -> torch.Tensor:
    """A pool [PAGES, Hkv, PAGE, D], the head of a buffer whose tail, as many pages again right
    after the pool, holds `canary`."""
    page_elements = KV_HEADS * PAGE * HEAD_DIM
    buffer = torch.full((2 * PAGES * page_elements,), canary)
    buffer[:PAGES * page_elements] = torch.randn(PAGES * page_elements, generator=generator)
    buffer = buffer.to(device)
    return buffer[:PAGES * page_elements].view(PAGES, KV_HEADS, PAGE, HEAD_DIM)


def page_table(generator, pages_per_seq: int) -> torch.Tensor:
    """[3, 1, pages_per_seq, 1] int32: distinct pages of the pool, out of order."""
    order = torch.randperm(PAGES, generator=generator)[:3 * pages_per_seq]
    return order.view(3, 1, pages_per_seq, 1).to(torch.int32)


def corrupt(table: torch.Tensor, bad_id: int, positions=("first", "last", "middle")) -> torch.Tensor:
    """A copy of `table` with `bad_id` on sequence b's page `positions[b]` (within its length)."""
    table = table.clone()
    for batch, position in enumerate(positions):
        used = -(-SEQ_LENS[batch] // PAGE)
        page = {"first": 0, "last": used - 1, "middle": used // 2}[position]
        table[batch, 0, page, 0] = bad_id
    return table


def paged_case(s_q: int, bad_id: int, tables: str, canary: float, device="cpu", causal=True, seed=0):
    """(graph, inputs) of a paged sdpa (o and stats) whose `tables` ("k", "v" or "both") hold
    `bad_id` on a page each sequence uses."""
    gen = torch.Generator().manual_seed(seed)
    k_pool, v_pool = pool_with_canary(gen, canary, device), pool_with_canary(gen, canary, device)
    table = page_table(gen, PAGES_PER_SEQ)
    k_table = corrupt(table, bad_id) if tables in ("k", "both") else table
    v_table = corrupt(table, bad_id) if tables in ("v", "both") else table.clone()
    q_t = torch.randn(3, HEADS, s_q, HEAD_DIM, generator=gen).to(device)
    g = dg.Graph(name="paged", io_data_type=dg.float32, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    q, k, v = (g.tensor_like(t, n) for t, n in ((q_t, "q"), (k_pool, "k"), (v_pool, "v")))
    kt, vt = (g.tensor(name=n, dim=[3, 1, PAGES_PER_SEQ, 1], data_type=dg.int32) for n in ("ktab", "vtab"))
    lens = g.tensor(name="lens", dim=[3, 1, 1, 1], data_type=dg.int32)
    inputs = {q: q_t, k: k_pool, v: v_pool, kt: k_table.to(device), vt: v_table.to(device),
              lens: torch.tensor(SEQ_LENS, dtype=torch.int32).view(3, 1, 1, 1).to(device)}
    o, stats = g.sdpa(q, k, v, is_inference=False, seq_len_kv=lens, paged_attention_k_table=kt,
                      paged_attention_v_table=vt, use_causal_mask_bottom_right=causal)
    o.set_output(True).set_name("o")
    stats.set_output(True).set_name("stats")
    return g, inputs


def check_paged(g, inputs, device="cpu", options=None):
    """Kernels (built with `options` where given) against the reference; o finite (no canary
    reached it)."""
    outputs = check(g, inputs, device=device, options=options)
    assert torch.isfinite(outputs["o"]).all()
    return outputs


@pytest.mark.parametrize("tables", ["k", "v", "both"])
@pytest.mark.parametrize("bad_id", BAD_IDS)
@pytest.mark.parametrize("s_q", [1, 6])  # decode, prefill
def test_ids_outside_the_pool_mask_their_keys(s_q, bad_id, tables):
    check_paged(*paged_case(s_q, bad_id, tables, CANARIES["nan" if bad_id % 2 else "huge"]))


@pytest.mark.parametrize("bad_id", [PAGES, -2**31, 2**31 - 1])
def test_split_decode_masks_them_too(bad_id):
    """Three splits of the keys and their combine: a split that sees only masked keys adds nothing."""
    g, inputs = paged_case(1, bad_id, "both", CANARIES["nan"], causal=False)
    g.build(options=dg.BuildOptions(sdpa_splits=3))
    assert g.plan.launches[-1].config_text.startswith("combine")
    check_paged(g, inputs)


def test_masked_means_invisible():
    """The kernel equals attention over the sequence's valid keys alone (torch's sdpa with an
    explicit mask, not dnngraph's reference), and a sequence whose every page id is bad is zero
    with stats -inf."""
    g, inputs = paged_case(3, PAGES + 1, "v", CANARIES["nan"], causal=False)
    by_name = {t.name: value for t, value in inputs.items()}
    by_name["vtab"][2] = -5  # sequence 2 sees no key at all
    outputs = run(g, inputs)
    table, k_table = by_name["vtab"], by_name["ktab"]
    for batch, length in enumerate(SEQ_LENS):
        keys = torch.arange(length)
        pages_k, pages_v = k_table[batch, 0, keys // PAGE, 0].long(), table[batch, 0, keys // PAGE, 0].long()
        valid = (pages_v >= 0) & (pages_v < PAGES)
        if not valid.any():
            assert (outputs["o"][batch] == 0).all() and (outputs["stats"][batch] == float("-inf")).all()
            continue
        k_rows = by_name["k"][pages_k[valid], :, keys[valid] % PAGE].transpose(0, 1)  # [Hkv, keys, D]
        v_rows = by_name["v"][pages_v[valid], :, keys[valid] % PAGE].transpose(0, 1)
        group = HEADS // KV_HEADS
        want = torch.nn.functional.scaled_dot_product_attention(
            by_name["q"][batch].double(), k_rows.repeat_interleave(group, 0).double(),
            v_rows.repeat_interleave(group, 0).double())
        assert torch.allclose(outputs["o"][batch].double(), want, atol=1e-5), batch


def test_generated_source_masks_every_paged_block():
    """No key block of a paged kernel is loaded without the pool bound in its mask."""
    g, _ = paged_case(6, 0, "k", 0.0, causal=False)
    g.build()
    source = open(g.plan.launches[0].source_path).read()
    assert "k_page < PAGES" in source and "v_page < PAGES" in source
    assert "k_tile = tl.load(k_ptr + k_rows[None, :] + cols_d[:, None] * k_s3, mask=key_in" in source
    for load in [line for line in source.splitlines() if "tile = tl.load(" in line and "_rows" in line]:
        assert "mask=key_in" in load, load


@pytest.mark.gpu
@pytest.mark.parametrize("tables", ["k", "v", "both"])
@pytest.mark.parametrize("bad_id", BAD_IDS)
@pytest.mark.parametrize("s_q", [1, 6, 70])
def test_ids_outside_the_pool_mask_their_keys_gpu(s_q, bad_id, tables):
    check_paged(*paged_case(s_q, bad_id, tables, CANARIES["nan" if bad_id % 2 else "huge"], device="cuda"),
                device="cuda")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 3])
def test_split_decode_masks_them_too_gpu(splits):
    for bad_id in (PAGES, -2**31, 2**31 - 1):
        check_paged(*paged_case(1, bad_id, "both", CANARIES["nan"], device="cuda", causal=False), device="cuda",
                    options=dg.BuildOptions(sdpa_splits=splits))
    torch.cuda.synchronize()


def sm90_graphs():
    """Built paged graphs for the sm_90 compile check: prefill, decode and the split decode."""
    for s_q in (1, 6):
        g, _ = paged_case(s_q, PAGES, "both", 0.0)
        g.build()
        yield f"paged s_q={s_q}", g
    g, _ = paged_case(1, PAGES, "both", 0.0, causal=False)
    g.build(options=dg.BuildOptions(sdpa_splits=3))
    yield "paged split decode", g


def test_paged_kernels_compile_for_sm90():
    from helpers import compiled_for_sm90
    assert "compiled 4 kernels for sm_90" in compiled_for_sm90("test_sdpa_paged:sm90_graphs", timeout=300)
