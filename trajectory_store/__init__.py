"""The trajectory store: token-exact calls in Parquet on any fsspec URL, trees and selection in DuckDB.

Public entry points: Store/StoreConfig (storage), Recorder (what the gateway calls), connect()
(DuckDB with the views), the processor (selection and packing), and the JSONL interchange.
"""
