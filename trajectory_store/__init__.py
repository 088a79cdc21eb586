"""The trajectory store: token-exact calls in Parquet on any fsspec URL, trees and selection in DuckDB.

Public entry points: Store/StoreConfig (storage), Recorder (what the gateway calls), connect()
(DuckDB with the views; read_only=True for user SQL), the processor (selection and packing), the
JSONL interchange, and parts (check every part, quarantine the unreadable ones).
"""
