"""The id table on a real transfer engine: entries name an export until cleared (its id
first), the table grows by registered chunks, and close() deregisters every chunk."""

from __future__ import annotations

from tests.transfer.util import need_mooncake

need_mooncake()

from aioprefill.transfer.backend import new_engine  # noqa: E402
from aioprefill.transfer.idtable import ENTRY_BYTES, IdTable  # noqa: E402


def test_entries_grow_by_chunks_and_clear_id_first():
    engine, session = new_engine("127.0.0.1", "tcp")
    assert session.startswith("127.0.0.1:")
    table = IdTable(engine)
    slots = [table.take(i + 1, 4096 * (i + 1), 64) for i in range(4097)]
    assert table.num_chunks == 2 and len(set(slots)) == 4097
    first, last = slots[0], slots[-1]
    assert table.address(slots[1]) - table.address(first) == ENTRY_BYTES
    words = table._words[first[0]][first[1]]
    assert words.tolist() == [1, 4096, 64, 0]
    assert not table.released(first, 1)
    words[3] = 1  # what a decode node's release_kv writes
    assert table.released(first, 1) and not table.released(first, 2)
    table.clear(first)
    assert words.tolist() == [0, 0, 0, 0]
    assert table.take(99, 8192, 64) == first  # a cleared entry is handed out again
    table.clear(last)
    maps = table.close()
    assert len(maps) == 2 and table.num_chunks == 0
    del words
    for mm in maps:
        mm.close()
