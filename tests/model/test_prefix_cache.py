"""The prefix cache inside PaddleRunner: a chunk that reads cached blocks answers exactly what
the whole prompt computed from scratch answers, for every output option (bitwise with
deterministic=True, within 1e-5 by default, within bf16 rounding for a default bfloat16 model's
hits: HIT_TOL): hits of one block and of all but the last token,
hits followed by more chunks, blocks written by a chunked prompt (a block straddling chunks), a
request reading what an earlier one of the same batch writes (alone, and after blocks whose
prompt outputs were kept), and the KV export."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging

import numpy as np
import pytest

from aioprefill.shm.segments import SHM_DIR, attach_segment, segment_name
from aioprefill.wire import protocol
from aioprefill.wire.kv import kv_layout
from aioprefill.workers.paddle.last_rows import last_rows_only
from aioprefill.workers.paddle.runner import PaddleRunner
from aioprefill.workers.prefix_blocks import BatchPlan
from aioprefill.workers.runner import ForwardOutput
from tests.model.batches import make_batch, small
from tests.model.prefix import (
    ALL,
    LABELS,
    LAST,
    B,
    check_same,
    concat_outputs,
    planned,
    with_options,
)

# bf16: a bfloat16 CPU model (bf16 products, slots holding K/V as bf16 bits). bf16-deterministic
# rounds K/V where they are made, so a hit is the miss bitwise; bf16 (default) attends to float32
# K/V and rounds what it stores: a hit (which attends to the stored bf16 K/V) is the miss within
# bf16 rounding (HIT_TOL), everything else as the float32 default mode.
MODES = ["default", "deterministic", "bf16", "bf16-deterministic"]
HIT_TOL = 2e-2  # bf16 default mode: a hit against the miss (relative above 1)
_ids = itertools.count(1000)


@functools.cache
def runner(mode: str) -> PaddleRunner:
    """One runner per mode for the module, with 64 slots."""
    dtype = "bfloat16" if mode.startswith("bf16") else "float32"
    spec = small(deterministic=mode.endswith("deterministic"), seed=31, dtype=dtype)
    return PaddleRunner(spec, prefix_cache_bytes=64 * 14978, block_tokens=B)


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, n).astype(np.int32)


def run(
    r: PaddleRunner,
    chunks: list[tuple[np.ndarray, int]],
    options: int = ALL,
    plans: list[tuple[list[int], list[int], int]] | None = None,
    top_k: int = 3,
) -> ForwardOutput:
    """One request fed in `chunks` ((tokens, start) each), one forward per chunk, each with its
    plan (reads, writes, first written block); the outputs joined as the engine joins them."""
    rid = next(_ids)
    outs = []
    for j, (tokens, start) in enumerate(chunks):
        batch = make_batch([tokens], ids=[rid], starts=[start], last=[j == len(chunks) - 1])
        batch = with_options(batch, [options], [top_k], labels=LABELS)
        if plans is not None:
            reads, writes, first = plans[j]
            batch = planned(batch, [reads], [writes], [first])
        outs.append(r.forward(batch))
    return concat_outputs(outs)


def whole(r: PaddleRunner, p: np.ndarray, options: int = ALL) -> ForwardOutput:
    return run(r, [(p, 0)], options)


def same(
    got: ForwardOutput, want: ForwardOutput, mode: str, what: str, *, hit: bool = False
) -> None:
    """`hit`: `got` read cached K/V (bf16 default mode: within HIT_TOL)."""
    bitwise, loose = mode.endswith("deterministic"), hit and mode == "bf16"
    tol = HIT_TOL if loose else 1e-5
    check_same(
        _no_ids(got), _no_ids(want), bitwise=bitwise, what=what, relative=loose, tol=tol, ties=loose
    )


def close_bits(x: np.ndarray, y: np.ndarray, tol: float = 2.0**-8) -> bool:
    """Two arrays of bf16 bits within `tol` of each other as values (relative above 1; the
    default: one rounding)."""
    a, b = (np.asarray(z, np.uint16).astype(np.uint32) << 16 for z in (x, y))
    va, vb = a.view(np.float32), b.view(np.float32)
    return bool((np.abs(va - vb) <= tol * np.maximum(1.0, np.abs(vb))).all())


def _no_ids(out: ForwardOutput) -> ForwardOutput:
    return dataclasses.replace(out, request_ids=np.zeros_like(out.request_ids))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("options", [ALL, LAST | protocol.OPT_NORMALIZE], ids=["mean", "last"])
def test_hits_equal_the_whole_prompt(mode: str, options: int) -> None:
    r = runner(mode)
    p = prompt(100, seed=1)
    want = whole(r, p, options)
    # The first request writes its six full blocks (its last token's block is not full).
    first = run(r, [(p, 0)], options, [([], [0, 1, 2, 3, 4, 5], 0)])
    same(first, want, mode, "writer")
    # The writer computed every position of its blocks: they keep its prompt outputs.
    store = r._store
    assert store is not None
    assert store.scored[:6].tolist() == [3 if options & protocol.OPT_PROMPT_TOP_K else 0] * 6
    # A hit of one block.
    same(run(r, [(p[B:], B)], options, [([0], [], 0)]), want, mode, "1 block", hit=True)
    # Fewer prompt top-k than kept (taken from the slots), more (the head on the hidden rows).
    for k in (2, 5):
        got = run(r, [(p[B:], B)], options, [([0], [], 0)], top_k=k)
        same(got, run(r, [(p, 0)], options, top_k=k), mode, f"top_k={k}", hit=True)
    # All but the last token: a 97-token prompt reads its 6 blocks and computes one token.
    short = p[: 6 * B + 1]
    same(
        run(r, [(short[6 * B :], 6 * B)], options, [([0, 1, 2, 3, 4, 5], [], 0)]),
        whole(r, short, options),
        mode,
        "all but the last token",
        hit=True,
    )
    # A hit, then the prompt goes on in two more chunks.
    chunks = [(p[2 * B : 60], 2 * B), (p[60:70], 60), (p[70:], 70)]
    plans = [([0, 1], [], 0), ([], [], 0), ([], [], 0)]
    same(run(r, chunks, options, plans), want, mode, "hit then chunks", hit=True)


@pytest.mark.parametrize("mode", MODES)
def test_blocks_written_across_chunks(mode: str) -> None:
    """A chunked prompt writes the blocks each chunk completes (blocks 2 and 3 straddle two
    chunks): the slots hold what a whole-prompt write holds, and a longer prompt hits all 5."""
    r = runner(mode)
    p = prompt(80, seed=2)
    chunks = [(p[:10], 0), (p[10:37], 10), (p[37:50], 37), (p[50:], 50)]
    plans = [([], [], 0), ([], [10, 11], 0), ([], [12], 2), ([], [13, 14], 3)]
    same(run(r, chunks, ALL, plans), whole(r, p), mode, "chunked writer")
    run(r, [(p, 0)], ALL, [([], [20, 21, 22, 23, 24], 0)])  # the same blocks, whole
    store = r._store
    assert store is not None
    for a, b in zip([10, 11, 12, 13, 14], [20, 21, 22, 23, 24], strict=True):
        pairs = [(kv[:, :, a], kv[:, :, b]) for kv in (store.keys, store.values)]
        pairs += [(store.hidden[a], store.hidden[b]), (store.tokens[a], store.tokens[b])]
        for x, y in pairs:
            if x.dtype == np.uint16 and not mode.endswith("deterministic"):
                assert close_bits(x, y), f"slot {a} vs {b}"  # rounded from within 1e-5
            elif mode.endswith("deterministic") or x.dtype.kind in "iu":
                assert np.array_equal(x, y), f"slot {a} vs {b}"
            else:
                assert np.abs(x - y).max() <= 1e-5
    longer = np.concatenate([p, prompt(7, seed=3)])
    got = run(r, [(longer[80:], 80)], ALL, [([10, 11, 12, 13, 14], [], 0)])
    same(got, whole(r, longer), mode, "hit on chunk-written blocks", hit=True)


@pytest.mark.parametrize("mode", MODES)
def test_piggyback_in_one_batch(mode: str) -> None:
    """Two requests share a 48-token prefix nobody cached: the first writes its blocks, the
    second reads them in the same forward, and both answer as if alone."""
    r = runner(mode)
    shared = prompt(48, seed=4)
    a = np.concatenate([shared, prompt(10, seed=5)])
    b = np.concatenate([shared, prompt(7, seed=6)])
    want_a, want_b = whole(r, a), whole(r, b)
    batch = make_batch([a, b[48:]], ids=[1, 2], starts=[0, 48])
    batch = with_options(batch, [ALL, ALL], [3, 3], labels=LABELS)
    batch = planned(batch, [[], [30, 31, 32]], [[30, 31, 32], []])
    out = r.forward(batch)
    assert out.request_ids.tolist() == [1, 2]
    for i, want in ((0, want_a), (1, want_b)):
        rows = [57, 54][i]
        sl = slice(0, 57) if i == 0 else slice(57, 57 + 54)
        one = ForwardOutput(
            request_ids=out.request_ids[i : i + 1] * 0,
            tokens=out.tokens[i : i + 1],
            logprobs=out.logprobs[i : i + 1],
            top_k_ids=out.top_k_ids[3 * i : 3 * i + 3],
            top_k_logprobs=out.top_k_logprobs[3 * i : 3 * i + 3],
            prompt_logprobs=out.prompt_logprobs[sl],
            prompt_top_k_ids=out.prompt_top_k_ids[3 * sl.start : 3 * sl.stop],
            prompt_top_k_logprobs=out.prompt_top_k_logprobs[3 * sl.start : 3 * sl.stop],
            embeddings=out.embeddings[i : i + 1],
            label_logprobs=out.label_logprobs[len(LABELS) * i : len(LABELS) * (i + 1)],
        )
        assert len(one.prompt_logprobs) == rows
        same(one, want, mode, f"request {i}", hit=i == 1)


def _one(out: ForwardOutput, i: int, rows: slice, k: int) -> ForwardOutput:
    """Request `i` of a batch's output (its prompt rows `rows`, `k` top-k per row)."""
    return ForwardOutput(
        request_ids=out.request_ids[i : i + 1] * 0,
        tokens=out.tokens[i : i + 1],
        logprobs=out.logprobs[i : i + 1],
        top_k_ids=out.top_k_ids[k * i : k * i + k],
        top_k_logprobs=out.top_k_logprobs[k * i : k * i + k],
        prompt_logprobs=out.prompt_logprobs[rows],
        prompt_top_k_ids=out.prompt_top_k_ids[k * rows.start : k * rows.stop],
        prompt_top_k_logprobs=out.prompt_top_k_logprobs[k * rows.start : k * rows.stop],
        embeddings=out.embeddings[i : i + 1],
        label_logprobs=out.label_logprobs[len(LABELS) * i : len(LABELS) * (i + 1)],
    )


@pytest.mark.parametrize("mode", MODES)
def test_reader_of_kept_and_piggybacked_blocks(mode: str) -> None:
    """lm-eval's choices of one question: the context's blocks were scored by an earlier
    request (their prompt outputs kept), the question's block is written in this forward by
    one choice and read by another. The reader takes the kept outputs of the old blocks, the
    head computes the new block's and its own rows, and both answer as if alone (top-1: the
    argmax, as the first of a top-3)."""
    r = runner(mode)
    context = prompt(32, seed=21)
    run(r, [(context, 0)], ALL, [([], [54, 55], 0)], top_k=1)  # kept with 1 top-k each
    question = np.concatenate([context, prompt(20, seed=22)])  # block 2: positions 32-47
    a = np.concatenate([question, prompt(3, seed=23)])
    b = np.concatenate([question, prompt(2, seed=24)])
    want = [run(r, [(p, 0)], ALL, top_k=1) for p in (a, b)]
    batch = with_options(
        make_batch([a[32:], b[48:]], ids=[1, 2], starts=[32, 48]), [ALL] * 2, [1, 1], labels=LABELS
    )
    out = r.forward(planned(batch, [[54, 55], [54, 55, 56]], [[56], []], [2, 0]))
    assert out.request_ids.tolist() == [1, 2]
    assert len(out.prompt_logprobs) == (len(a) - 1) + (len(b) - 1)
    same(_one(out, 0, slice(0, len(a) - 1), 1), want[0], mode, "the writer", hit=True)
    reader = _one(out, 1, slice(len(a) - 1, len(a) + len(b) - 2), 1)
    same(reader, want[1], mode, "the reader", hit=True)
    top3 = run(r, [(a, 0)], ALL, top_k=3)
    assert want[0].prompt_top_k_ids.tolist() == top3.prompt_top_k_ids[::3].tolist()
    assert want[0].top_k_ids.tolist() == top3.top_k_ids[:1].tolist()
    if mode.endswith("deterministic"):
        assert want[0].prompt_top_k_logprobs.tolist() == top3.prompt_top_k_logprobs[::3].tolist()


@pytest.mark.parametrize("mode", MODES)
def test_kv_export_holds_the_whole_prompt(mode: str) -> None:
    r = runner(mode)
    p = prompt(45, seed=7)
    run(r, [(p, 0)], 0, [([], [40, 41], 0)])
    names = [segment_name("kv.prefix-test") for _ in range(2)]
    layout = kv_layout(r.spec)
    kv = protocol.OPT_RETURN_KV
    try:
        r.forward(with_options(make_batch([p], ids=[next(_ids)]), [kv], [0], names[:1]))
        hit = make_batch([p[2 * B :]], ids=[next(_ids)], starts=[2 * B])
        r.forward(planned(with_options(hit, [kv], [0], names[1:]), [[40, 41]]))
        got = []
        for name in names:
            mm = attach_segment(name)
            got.append([a.copy() for a in layout.views(mm, len(p))])
            mm.close()
        for x, y in zip(*got, strict=True):
            if mode.endswith("deterministic"):
                assert np.array_equal(x, y)
            elif x.dtype == np.uint16:  # bf16 bits: the hit's own K/V attended to cached ones
                assert close_bits(x, y, HIT_TOL)
            else:
                assert np.abs(x - y).max() <= 1e-5
    finally:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / name).unlink()


@pytest.mark.parametrize("mode", MODES)
def test_chunks_equal_the_whole_prompt(mode: str) -> None:
    """Without the cache too: attention tiles sit at absolute positions, so chunk cuts (inside
    a tile, at its edge, one token) change no bit of any output in deterministic mode, and no
    output by more than 1e-5 by default."""
    r = runner(mode)
    p = prompt(150, seed=8)
    want = whole(r, p)
    for cuts in ([1], [63, 64], [10, 75, 149], [64, 128]):
        bounds = [0, *cuts, len(p)]
        chunks = [(p[a:b], a) for a, b in itertools.pairwise(bounds)]
        same(run(r, chunks), want, mode, f"cuts {cuts}")


def test_default_mode_takes_onednn_where_only_mkls_rows_move(monkeypatch, caplog) -> None:
    """Where MKL's rows move at 64 rows or more and oneDNN's hold (the check's verdicts set
    here), the default mode multiplies on oneDNN with its floor, and a hit is the cache-off run."""
    from aioprefill.workers.paddle import rows as paddle_rows

    monkeypatch.delenv("AIOPREFILL_CPU_GEMM", raising=False)
    verdict = lambda mm, *a: (16, {}) if mm.uses_onednn else (None, {"down": [64]})  # noqa: E731
    monkeypatch.setattr(paddle_rows, "row_floor", verdict)
    with caplog.at_level(logging.INFO, logger="aioprefill.worker"):
        r = PaddleRunner(runner("default").spec, prefix_cache_bytes=8 * 14978, block_tokens=B)
    assert (r._mm.uses_onednn, r._mm.tile_rows, r._floor) == (True, None, 16)
    assert "the products run on oneDNN" in caplog.text
    p = prompt(70, seed=9)
    want = whole(r, p)
    same(run(r, [(p, 0)], ALL, [([], [0, 1, 2, 3], 0)]), want, "default", "writer")
    same(run(r, [(p[3 * B :], 3 * B)], ALL, [([0, 1, 2], [], 0)]), want, "default", "hit")


def test_default_mode_warns_and_pads_to_64_rows_where_rows_move(monkeypatch, caplog) -> None:
    """Where the start-up check finds a product whose rows move with the row count at 64 rows or
    more, the default mode keeps untiled products on at least 64 rows (fixed tiles would cost
    1.6-1.8x: paddle_rows) and says that hits may then differ by rounding; the padded products
    answer as before. (The check's verdict is set here: which products move depends on the CPU
    and threads.)"""
    from aioprefill.workers.paddle import rows as paddle_rows

    monkeypatch.setattr(paddle_rows, "row_floor", lambda *a: (None, {"down": [64]}))
    with caplog.at_level(logging.WARNING, logger="aioprefill.worker"):
        padded = PaddleRunner(runner("default").spec, prefix_cache_bytes=8 * 14978, block_tokens=B)
    assert (padded._mm.tile_rows, padded._floor) == (None, 64)
    assert "may differ from the cache-off answer" in caplog.text
    p = prompt(70, seed=9)
    want = whole(padded, p)
    same(run(padded, [(p, 0)], ALL, [([], [0, 1, 2, 3], 0)]), want, "default", "writer")
    same(run(padded, [(p[3 * B :], 3 * B)], ALL, [([0, 1, 2], [], 0)]), want, "default", "hit")
    same(run(padded, [(p[:9], 0), (p[9:], 9)]), want, "default", "chunks")


def test_plans_the_runner_cannot_follow_are_refused() -> None:
    r = runner("default")
    p = prompt(40, seed=9)
    cases = [
        (planned(make_batch([p[B:]], starts=[B]), [[64]]), "slot past"),
        (planned(make_batch([p[B:]], starts=[B]), [[0, 1]]), "2 blocks read"),
        (planned(make_batch([p[:20]]), None, [[0, 1]], [0]), "past its chunk"),
    ]
    for batch, match in cases:
        with pytest.raises(ValueError, match=match):
            r.forward(batch)
    # A slot no forward wrote, and one whose writing forward failed (its KV export could not
    # be opened), are never read: the batch is refused rather than answered from them.
    with pytest.raises(ValueError, match="reads slot 63, which holds no block"):
        r.forward(planned(make_batch([p[B:]], starts=[B]), [[63]]))
    r.forward(planned(make_batch([p]), None, [[62]], [0]))
    bad = with_options(make_batch([p]), [protocol.OPT_RETURN_KV], [0], ["x" * 300])
    with pytest.raises(OSError):
        r.forward(planned(bad, None, [[62]], [0]))
    with pytest.raises(ValueError, match="reads slot 62, which holds no block"):
        r.forward(planned(make_batch([p[B:]], starts=[B]), [[62]]))
    off = PaddleRunner(small(seed=31))
    assert (off.cache_blocks, off.block_bytes) == (0, 14978)
    with pytest.raises(ValueError, match="none are kept"):
        off.forward(planned(make_batch([p]), None, [[0]], [0]))


def test_slots_take_memory_only_as_they_are_written() -> None:
    """A 1 GiB budget is allocated at start but touched as slots are written: the worker's
    resident memory grows with the blocks held, not with the budget."""

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) << 10

    spec = small(seed=32)
    before = rss()
    r = PaddleRunner(spec, prefix_cache_bytes=1 << 30, block_tokens=B)
    assert r.cache_blocks == (1 << 30) // 14978
    assert rss() - before < 64 << 20  # the weights and the runner, not the 1 GiB
    p = prompt(B * 40 + 1, seed=10)
    before = rss()
    r.forward(planned(make_batch([p]), None, [list(range(40))], [0]))
    assert rss() - before < (40 * 14978 + (64 << 20))


@pytest.mark.parametrize("mode", MODES)
def test_readers_of_the_same_slots_in_one_batch(mode: str) -> None:
    """A burst sharing a cached prefix: every reader of the same slots answers as if alone
    (they share one copy of the cached K/V per layer), the last one going on in a second
    chunk."""
    r = runner(mode)
    shared = prompt(64, seed=11)
    run(r, [(shared, 0)], 0, [([], [50, 51, 52, 53], 0)])
    full = [np.concatenate([shared, prompt(3 + 9 * i, seed=12 + i)]) for i in range(3)]
    extra = prompt(20, seed=20)
    batch = make_batch([f[64:] for f in full], ids=[1, 2, 3], starts=[64] * 3)
    batch = dataclasses.replace(batch, is_last=np.array([True, True, False]))
    out = r.forward(planned(batch, [[50, 51, 52, 53]] * 3))
    assert out.request_ids.tolist() == [1, 2]
    rest = r.forward(make_batch([extra], ids=[3], starts=[len(full[2])]))
    got = [(out.tokens[0], out.logprobs[0]), (out.tokens[1], out.logprobs[1])]
    got.append((rest.tokens[0], rest.logprobs[0]))
    wholes = [full[0], full[1], np.concatenate([full[2], extra])]
    for (token, logprob), p in zip(got, wholes, strict=True):
        want = r.forward(make_batch([p], ids=[next(_ids)]))
        assert token == want.tokens[0]
        if mode.endswith("deterministic"):
            assert logprob == want.logprobs[0]
        else:
            assert abs(logprob - want.logprobs[0]) <= (HIT_TOL if mode == "bf16" else 1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_a_next_token_hit_runs_its_last_layer_on_the_last_row(mode: str) -> None:
    """A hit asking only for what the last row gives (next token, top-k, labels, the last row's
    embedding) writes no block, so a bf16 model runs its last layer on that row alone
    (`paddle.last_rows`): bitwise the same hit run with the layer whole (mean pooling asked),
    and the whole prompt's answer as any hit is (bitwise in the deterministic modes)."""
    r = runner(mode)
    p = prompt(90, seed=11)
    opts = protocol.OPT_EMBED_LAST
    # writes its blocks with their hidden rows (mean pooling asked: the layer whole), which the
    # whole-layer read below needs
    run(r, [(p, 0)], opts | protocol.OPT_EMBED_MEAN, [([], [60, 61, 62], 0)])
    plan = [([60, 61, 62], [], 0)]
    batch = planned(make_batch([p[3 * B :]], starts=[3 * B]), *map(list, zip(*plan, strict=True)))
    # the bf16 modes (and float32 on oneDNN: `attention.tiles_attention`)
    assert last_rows_only(batch, BatchPlan.of(batch), r._mm, r._bf16) or not r._bf16
    got = run(r, [(p[3 * B :], 3 * B)], opts, plan)
    full = run(r, [(p[3 * B :], 3 * B)], opts | protocol.OPT_EMBED_MEAN, plan)
    for name in ("tokens", "logprobs", "top_k_ids", "top_k_logprobs", "label_logprobs"):
        assert np.array_equal(getattr(got, name), getattr(full, name)), name
    same(got, whole(r, p, opts), mode, "a next-token hit", hit=True)


@pytest.mark.parametrize("mode", MODES)
def test_a_next_token_writer_keeps_its_blocks_without_hidden_rows(mode: str) -> None:
    """A next-token batch that writes blocks runs its last layer on the last rows too: its
    answer is the whole layer's bitwise, its slots keep K/V and token ids but no hidden rows
    (`BlockStore.has_rows`), a next-token hit of them answers as any hit, and a read that needs
    their rows (prompt logprobs, mean pooling) is refused before anything runs."""
    r = runner(mode)
    store = r._store
    assert store is not None
    p = prompt(90, seed=12)
    opts = protocol.OPT_EMBED_LAST
    batch = planned(make_batch([p]), None, [[56, 57, 58]], [0])
    trims = last_rows_only(batch, BatchPlan.of(batch), r._mm, r._bf16)
    assert trims or not r._bf16  # (float32 too on oneDNN: `attention.tiles_attention`)
    wrote = run(r, [(p, 0)], opts, [([], [56, 57, 58], 0)])
    assert np.array_equal(wrote.tokens, whole(r, p, opts).tokens)
    for name in ("logprobs", "top_k_logprobs", "label_logprobs", "embeddings"):
        assert np.array_equal(getattr(wrote, name), getattr(whole(r, p, opts), name)), name
    assert store.has_rows[[56, 57, 58]].tolist() == [not trims] * 3
    assert store.ready[[56, 57, 58]].all()
    plan = [([56, 57, 58], [], 0)]
    same(run(r, [(p[3 * B :], 3 * B)], opts, plan), whole(r, p, opts), mode, "hit", hit=True)
    if trims:
        for needs in (protocol.OPT_PROMPT_LOGPROBS, protocol.OPT_EMBED_MEAN):
            with pytest.raises(ValueError, match="reads the hidden rows of slot 56"):
                run(r, [(p[3 * B :], 3 * B)], needs, plan)
