"""The decode batch's keys and values (engine/slot_cache.py `SlotKVCache`, through the engine's
cache protocol `LOCAL`): a row joining writes only itself into a free slot, rows leaving move only
the rows that fill their holes, and across joins and leaves of rows of very different lengths
every row's keys, values and logits are those mlx-lm's `BatchKVCache` gives it, and those it gets
decoding alone."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from engine.model_cache import LOCAL
from engine.slot_cache import keep_order, slots_for
from tiny_models import tiny_llama, tiny_llama_pair

pytestmark = pytest.mark.fast

HEADS, DIM = 2, 64


def address(a: mx.array) -> int:
    """Where `a`'s data lives (the view is gone when this returns, so it holds nothing)."""
    return np.asarray(memoryview(a)).__array_interface__["data"][0]


def random_rows(lengths, seed=0, layers=2):
    """One model cache per length: `layers` KVCaches of random keys and values."""
    out = []
    for i, n in enumerate(lengths):
        mx.random.seed(seed + i)
        cache = []
        for _ in range(layers):
            layer = KVCache()
            kv = mx.random.normal((2, 1, HEADS, n, DIM))
            layer.update_and_fetch(kv[0], kv[1])
            cache.append(layer)
        mx.eval([c.state for c in cache])
        out.append(cache)
    return out


def held(layer, i):
    """Row `i`'s keys and values, its tokens only (views of the buffers)."""
    first = layer._idx - int(layer.offset[i].item())
    return layer.keys[i, :, first : layer._idx], layer.values[i, :, first : layer._idx]


def copied(layer, i):
    """Row `i`'s keys and values as numpy copies (which hold none of the buffers' memory: a view
    held would make every write into the buffers a copy)."""
    return tuple(np.array(a) for a in held(layer, i))


def same(a, b) -> bool:
    return np.array_equal(np.array(a), np.array(b))


def step(batch):
    """One token written into every row (a decode step's update), evaluated."""
    rows = batch[0].offset.shape[0]
    for layer in batch:
        layer.update_and_fetch(mx.ones((rows, HEADS, 1, DIM)), mx.ones((rows, HEADS, 1, DIM)))
    mx.eval([layer.state for layer in batch])


def extra_bytes(edit) -> int:
    """MLX memory `edit()` needed beyond what was held before it."""
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    edit()
    mx.synchronize()
    return mx.get_peak_memory() - before


def test_keep_order_fills_each_hole_with_one_of_the_last_rows():
    assert keep_order(5, [4]) == [0, 1, 2, 3]
    assert keep_order(5, [1]) == [0, 4, 2, 3]
    assert keep_order(6, [0, 2]) == [4, 1, 5, 3]
    assert keep_order(6, [1, 5]) == [0, 4, 2, 3]
    assert keep_order(3, [0, 1, 2]) == []


def test_a_row_joining_writes_only_itself_into_a_free_slot():
    """Once the buffers have a free slot, a joining row is written into it: every layer's
    buffers stay where they are (same memory), the other rows unchanged, and the join needs no
    memory beyond the joining row's (mlx-lm's `extend` of the same rows builds new buffers: the
    measure sees that copy)."""
    rows = random_rows([500, 480, 450, 490, 470, 460, 300, 20, 400, 490])
    batch = LOCAL.merge(rows[:8])
    assert batch[0].slots == 8  # merged: no free slot
    step(batch)  # a decode step's growth: room past the index, and free slots
    assert batch[0].slots == slots_for(8) > 9
    LOCAL.extend(batch, LOCAL.merge([rows[8]]))
    mx.eval([layer.state for layer in batch])
    before = [[copied(layer, i) for i in range(9)] for layer in batch]
    where = [(address(layer.keys), address(layer.values)) for layer in batch]
    joining = LOCAL.merge([rows[9]])
    mx.eval([layer.state for layer in joining])
    used = extra_bytes(lambda: (LOCAL.extend(batch, joining),
                                mx.eval([layer.state for layer in batch])))
    buffers = batch[0].keys.nbytes + batch[0].values.nbytes
    assert used < buffers / 8, (used, buffers)
    assert [(address(layer.keys), address(layer.values)) for layer in batch] == where
    for layer, kept in zip(batch, before):
        assert layer.padding == layer.left_padding.tolist()
        for i, (k, v) in enumerate(kept):
            a, b = held(layer, i)
            assert same(a, k) and same(b, v)
    for layer, mine in zip(batch, rows[9]):
        k, v = held(layer, 9)
        assert mx.array_equal(k, mine.keys[0, :, :490]).item()
        assert mx.array_equal(v, mine.values[0, :, :490]).item()

    theirs = [BatchKVCache.merge(list(c)) for c in zip(*rows[:9])]
    mx.eval([layer.state for layer in theirs])
    other = [BatchKVCache.merge([c]) for c in rows[9]]
    mx.eval([layer.state for layer in other])
    their_used = extra_bytes(lambda: ([a.extend(b) for a, b in zip(theirs, other)],
                                  mx.eval([layer.state for layer in theirs])))
    assert their_used > theirs[0].keys.nbytes


def test_rows_leaving_move_only_the_rows_that_fill_their_holes():
    """A middle row leaving: the batch's last row moves into its slot (the only copy), every
    other row stays where it was, the buffers too; a last row leaving moves nothing."""
    rows = random_rows([300, 310, 290, 305, 280, 295, 300, 302])
    batch = LOCAL.merge(rows)
    step(batch)
    before = [[copied(layer, i) for i in range(8)] for layer in batch]
    where = [(address(layer.keys), address(layer.values)) for layer in batch]
    keep = keep_order(8, [2])
    assert keep == [0, 1, 7, 3, 4, 5, 6]
    used = extra_bytes(lambda: (LOCAL.filter(batch, keep), mx.eval([l.state for l in batch])))
    row_bytes = 2 * batch[0].keys.nbytes // batch[0].slots  # one slot's keys and values
    assert used <= len(batch) * row_bytes * 1.5, (used, row_bytes)  # one row a layer
    assert [(address(layer.keys), address(layer.values)) for layer in batch] == where
    for layer, kept in zip(batch, before):
        for i, j in enumerate(keep):
            a, b = held(layer, i)
            assert same(a, kept[j][0]) and same(b, kept[j][1])
    used = extra_bytes(lambda: (LOCAL.filter(batch, keep_order(7, [6])),
                                mx.eval([l.state for l in batch])))
    assert used < row_bytes / 4


def test_buffers_shrink_once_most_rows_or_columns_are_unused():
    """Rows leaving leave the buffers as they are until they are far too large: then the kept
    rows are copied into buffers of their size, the columns no row uses dropped (a long row that
    left)."""
    rows = random_rows([40, 30, 2000, 35] + [50] * 12)
    batch = LOCAL.merge(rows)
    step(batch)
    LOCAL.filter(batch, keep_order(16, [2]))  # the long row leaves: most columns unused
    assert batch[0]._idx == 51 and min(batch[0].padding) == 0
    assert batch[0].keys.shape[2] < 2001
    slots = batch[0].slots
    LOCAL.filter(batch, keep_order(15, [3, 4, 5]))
    assert batch[0].slots == slots
    LOCAL.filter(batch, keep_order(12, list(range(2, 12))))
    assert batch[0].slots == slots_for(2)
    for layer, mine in zip(batch, rows[0]):
        assert mx.array_equal(held(layer, 0)[0][:, :40], mine.keys[0, :, :40]).item()


def one_op_graph(a: mx.array) -> str:
    """`a`'s (unevaluated) graph as mx.export_to_dot writes it."""
    import io

    out = io.StringIO()
    mx.export_to_dot(out, a)
    return out.getvalue()


def _logits(model, cache, tokens):
    return model(mx.array([[t] for t in tokens]), cache=cache)[:, -1, :]


@pytest.mark.parametrize("kernels", [False, True])
def test_rows_joining_and_leaving_decode_as_alone_and_as_in_mlx_lms_batch(kernels):
    """Rows of very different lengths (3 to 300 tokens) join and leave a batch (a long row
    joining short ones, short rows joining a long one, rows leaving from the middle and the end),
    one greedy step between edits: each row's logits equal, bit for bit, those of the same rows
    in mlx-lm's `BatchKVCache` edited the same way, and match the row decoding alone. Both on
    MLX's ops (fp32) and on our CPU kernels (one op a layer over the free slots)."""
    if kernels:
        model, _ = tiny_llama_pair(4, 32, True)
    else:
        model = tiny_llama().model
    vocab = model.args.vocab_size
    lengths = [9, 3, 300, 14, 5, 120, 7, 60]
    caches, last = [], []
    for i, n in enumerate(lengths):
        cache = make_prompt_cache(model)
        logits = model(mx.array([[(13 * i + 7 * j) % (vocab - 1) + 1 for j in range(n)]]),
                       cache=cache)
        mx.eval(logits)
        caches.append(cache)
        last.append(int(mx.argmax(logits[0, -1]).item()))
    alone = [LOCAL.restore(LOCAL.copy(c), n) for c, n in zip(caches, lengths)]
    ours = LOCAL.merge([LOCAL.restore(caches[i], lengths[i]) for i in (0, 1)])
    theirs = [BatchKVCache.merge(list(c)) for c in zip(*[caches[i] for i in (0, 1)])]
    order = [0, 1]  # the requests in our batch's rows; mlx-lm's keeps them in joining order
    their_order = [0, 1]
    free_slots_stepped = False
    edits = [("join", [2]), ("join", [3, 4]), ("leave", [1]), ("join", [5]), ("leave", [0, 5]),
             ("join", [6, 7]), ("leave", [7])]
    for kind, who in edits:
        if kind == "join":
            LOCAL.extend(ours, LOCAL.merge([LOCAL.restore(caches[i], lengths[i]) for i in who]))
            for layer, rows in zip(theirs, zip(*[caches[i] for i in who])):
                layer.extend(BatchKVCache.merge(list(rows)))
            order += who
            their_order += who
        else:
            keep = keep_order(len(order), [order.index(i) for i in who])
            LOCAL.filter(ours, keep)
            order = [order[j] for j in keep]
            their_keep = [j for j, i in enumerate(their_order) if i not in who]
            for layer in theirs:
                layer.filter(mx.array(their_keep))
            their_order = [their_order[j] for j in their_keep]
        tokens = [last[i] for i in order]
        a = _logits(model, ours, tokens)
        if kernels and ours[0].slots > len(order) and ours[0]._idx < ours[0].keys.shape[2]:
            assert "MlxchatDecodeLayer" in one_op_graph(a)  # the one op over the free slots
            free_slots_stepped = True
        b = _logits(model, theirs, [last[i] for i in their_order])
        mx.eval(a, b)
        for row, i in enumerate(order):
            solo = _logits(model, alone[i], [last[i]])
            assert mx.array_equal(a[row], b[their_order.index(i)]).item(), (kind, who, i)
            assert mx.allclose(a[row], solo[0], atol=1e-4).item(), (kind, who, i)
            assert int(mx.argmax(a[row]).item()) == int(mx.argmax(solo[0]).item())
        for i in order:
            last[i] = int(mx.argmax(a[order.index(i)]).item())
    assert free_slots_stepped or not kernels


def test_rows_decode_across_a_growth_after_the_longest_row_left():
    """The longest row leaves (every kept row then has padding), and the kept rows decode past
    the buffers' end: the growth keeps the rows where they are, so the mask mlx-lm built for that
    step (before the layers grew the buffers) and the rows' `left_padding` still match the keys,
    and every row's logits stay those of the row decoding alone (MLX's ops, fp32)."""
    model = tiny_llama().model
    vocab = model.args.vocab_size
    lengths = [200, 230, 190]
    caches, last = [], []
    for i, n in enumerate(lengths):
        cache = make_prompt_cache(model)
        logits = model(mx.array([[(11 * i + 5 * j) % (vocab - 1) + 1 for j in range(n)]]), cache=cache)
        mx.eval(logits)
        caches.append(cache)
        last.append(int(mx.argmax(logits[0, -1]).item()))
    alone = [LOCAL.restore(LOCAL.copy(c), n) for c, n in zip(caches, lengths)]
    batch = LOCAL.merge([LOCAL.restore(c, n) for c, n in zip(caches, lengths)])
    LOCAL.filter(batch, keep_order(3, [1]))  # the long row leaves; rows 0 and 2 keep padding
    order = [0, 2]
    assert min(batch[0].padding) > 0
    width, grew = batch[0].keys.shape[2], False
    for _ in range(width - batch[0]._idx + 3):
        a = _logits(model, batch, [last[i] for i in order])
        mx.eval(a)
        grew = grew or batch[0].keys.shape[2] > width
        for row, i in enumerate(order):
            solo = _logits(model, alone[i], [last[i]])
            assert mx.allclose(a[row], solo[0], atol=1e-4).item(), (i, batch[0]._idx)
            last[i] = int(mx.argmax(a[row]).item())
        assert batch[0].left_padding.tolist() == batch[0].padding
    assert grew
