"""How SqlStore reads delivery pages: each page a seek in the key index, whatever the
database and however many pages one read takes (storage.store._page_statements)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from storage import SqlStore
from storage.store import READ_PAGES, _page_statements


@pytest.mark.parametrize("pages", [1, 3, READ_PAGES + 1])
async def test_every_page_of_a_read_is_a_seek_in_the_key_index(store: SqlStore, pages: int) -> None:
    """A read runs on the delivery path for every page of every partition: a scan of
    kg_messages or a sort of its rows would grow with the queue's depth. Where a page ends
    (core.actions.fetched) is found in the index of the large messages alone."""
    wanted = [(p, 10 * p, 20, 64 * 1024) for p in range(pages)]
    async with store.transaction() as conn:
        postgres = conn.dialect.name == "postgresql"
        statements = _page_statements("orders", wanted, postgres)
        assert len(statements) == (1 if postgres else -(-pages // READ_PAGES))
        for statement, params in statements:
            if postgres:
                await conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
                explain = "EXPLAIN"
            else:
                explain = "EXPLAIN QUERY PLAN"
            plan = await conn.execute(sa.text(f"{explain} {statement.text}"), params)
            text = "\n".join(str(row[-1]) for row in plan)
            if postgres:
                assert "Index Scan using kg_messages_pkey on kg_messages" in text, text
                assert "Index Only Scan using ix_kg_messages_large" in text, text
                assert "Seq Scan on kg_messages" not in text and "Sort" not in text, text
            else:
                assert "USING COVERING INDEX" in text or "USING INDEX" in text, text
                assert "USING COVERING INDEX ix_kg_messages_large" in text, text
                assert "SCAN kg_messages" not in text and "TEMP B-TREE" not in text, text
