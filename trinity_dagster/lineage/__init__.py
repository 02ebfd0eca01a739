"""What trained what: the lineage ledger, the queries on it, and the exactly-once proof."""
