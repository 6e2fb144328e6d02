"""The named statements of sql/queries.sql, as the store sends them."""

from __future__ import annotations

from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

from taskq._core.db import queries


def test_every_statement_fits_psycopgs_query_cache() -> None:
    # psycopg converts a query's %(name)s placeholders once and caches the result, but only for queries up
    # to MAX_CACHED_STATEMENT_LENGTH bytes: a longer one is parsed again on every execution, and the claim
    # runs once per fetched batch. Comments stay in the file for readers and are not sent.
    sizes = {name: len(sql.encode()) for name, sql in queries().items()}
    assert sizes and max(sizes.values()) <= MAX_CACHED_STATEMENT_LENGTH, sizes
    assert not [name for name, sql in queries().items() if "\n--" in sql or sql.startswith("--")]
