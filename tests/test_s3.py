"""The trajectory store on an s3:// data_root, against a real S3 API server on loopback (moto's server,
talked to over HTTP by s3fs, DuckDB and boto3; nothing is mocked): the same import gives the same
trees, selection and training tokens as on a local disk, export is exact, the CLI works, the standard
AWS variables alone are enough, and the bucket only ever holds committed parts and manifests."""

from __future__ import annotations

import json
import re

import boto3
import pytest

from tests.records import SAMPLE, assert_same_records, read_jsonl
from trajectory_store.db import connect
from trajectory_store.interchange import export_jsonl, import_jsonl
from trajectory_store.storage import Store, StoreConfig

VIEWS = ("execution_stats", "tree_nodes", "selected_trajectories", "training_tokens")


def bucket_keys(endpoint: str, bucket: str, prefix: str = "") -> dict[str, int]:
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    keys: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.update({obj["Key"]: obj["Size"] for obj in page.get("Contents", [])})
    return keys


def view_rows(con, view: str) -> list[tuple]:
    return con.sql(f"SELECT * FROM {view} ORDER BY ALL").fetchall()


@pytest.fixture(scope="module")
def sample_on_s3_and_local(s3_server, tmp_path_factory):
    """The sample trace imported once into s3:// and once into a local folder, with every view's rows."""
    bucket = "gyre-s3-views"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    stores = {
        "s3": Store(StoreConfig(data_root=f"s3://{bucket}/runs", s3_endpoint_url=s3_server, campaign="c1")),
        "local": Store(StoreConfig(data_root=str(tmp_path_factory.mktemp("local") / "runs"), campaign="c1")),
    }
    result = {"bucket": bucket, "endpoint": s3_server, "stores": stores}
    for name, store in stores.items():
        report = import_jsonl(store, str(SAMPLE))
        assert report.quarantined == 0, report.errors
        con = connect(store)
        result[name] = {view: view_rows(con, view) for view in VIEWS}
    return result


@pytest.mark.parametrize("view", VIEWS)
def test_s3_views_match_local_import(sample_on_s3_and_local, view):
    s3_rows = sample_on_s3_and_local["s3"][view]
    local_rows = sample_on_s3_and_local["local"][view]

    assert local_rows, f"{view} is empty: the comparison would prove nothing"
    assert s3_rows == local_rows


def test_a_steps_connection_holds_its_parts_and_gives_the_same_views(sample_on_s3_and_local):
    """What a step's pack opens: its step's parts fetched at once into memory, the same rows in every
    view as the views over the parts in S3."""
    store = sample_on_s3_and_local["stores"]["s3"]
    [step] = store.steps()
    con = connect(store, steps=[step])

    assert con.sql(
        "SELECT table_type FROM information_schema.tables WHERE table_name = 'calls_raw'"
    ).fetchall() == [("BASE TABLE",)]
    for view in VIEWS:
        assert view_rows(con, view) == sample_on_s3_and_local["s3"][view], view
    assert connect(store, steps=[step + 1]).sql("SELECT count(*) FROM calls").fetchall() == [(0,)]


def test_s3_export_round_trip_is_exact(sample_on_s3_and_local, tmp_path):
    out = tmp_path / "export.jsonl"

    counts = export_jsonl(sample_on_s3_and_local["stores"]["s3"], str(out))

    original = read_jsonl(SAMPLE)
    assert counts == {"executions": 4, "calls": 55}
    assert_same_records(original, read_jsonl(out))


def test_cli_import_and_sql_on_s3(s3_bucket, cli_env, capsys):
    from cli.main import main

    endpoint, bucket = s3_bucket
    store_args = ["--data-root", f"s3://{bucket}/p", "--s3-endpoint-url", endpoint]

    assert main(["traj", "import", str(SAMPLE), *store_args]) == 0
    imported = capsys.readouterr()
    assert "55 calls" in imported.out and "error" not in imported.err  # stderr also gets the server's log

    assert main(["sql", *store_args, "--format", "json", "SELECT count(*) AS n FROM calls"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": 55}]
    assert any(key.startswith("p/campaigns/default/calls/") for key in bucket_keys(endpoint, bucket))


def test_endpoint_and_credentials_from_aws_variables_alone(s3_bucket, monkeypatch, tmp_path):
    """No endpoint or keys in the config: s3fs/botocore take AWS_ENDPOINT_URL and the AWS keys
    (set by the s3_server fixture) from the environment."""
    endpoint, bucket = s3_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    config = StoreConfig(data_root=f"s3://{bucket}/env-only", campaign="c1")
    assert config.s3_endpoint_url is None and config.aws_access_key_id is None

    report = import_jsonl(Store(config), str(SAMPLE))

    assert report.quarantined == 0 and report.calls == 55
    assert any(key.startswith("env-only/campaigns/c1/calls/") for key in bucket_keys(endpoint, bucket))
    reader = Store(config)  # a fresh filesystem object, also configured from the environment only
    assert reader.read_table("calls").num_rows == 55
    out = tmp_path / "export.jsonl"
    export_jsonl(reader, str(out))
    assert_same_records(read_jsonl(SAMPLE), read_jsonl(out))


def committed_objects(store: Store, prefix: str) -> tuple[set[str], int]:
    """The object keys that the store's manifests list (parts), and how many manifests there are."""
    manifests = store.manifests()
    campaign_prefix = f"{prefix}/campaigns/{store.config.campaign}/"
    parts = {campaign_prefix + rel for m in manifests for paths in m["files"].values() for rel in paths}
    return parts, len(manifests)


def test_bucket_holds_only_committed_parts_and_manifests_and_reimport_is_idempotent(s3_bucket):
    endpoint, bucket = s3_bucket
    store = Store(StoreConfig(data_root=f"s3://{bucket}/runs", s3_endpoint_url=endpoint, campaign="c1"))
    manifest_key = re.compile(r"^runs/campaigns/c1/manifests/step=\d+/[0-9a-f]{20}\.json$")

    import_jsonl(store, str(SAMPLE))
    first = bucket_keys(endpoint, bucket)
    parts, n_manifests = committed_objects(store, "runs")
    manifests = {key for key in first if manifest_key.match(key)}

    assert parts, "the import committed nothing"
    assert set(first) == parts | manifests, "objects that no manifest lists (temporary or partial files?)"
    assert len(manifests) == n_manifests
    rows = {kind: store.read_table(kind).num_rows for kind in ("executions", "calls")}
    assert rows == {"executions": 4, "calls": 55}

    report = import_jsonl(store, str(SAMPLE))

    assert report.quarantined == 0
    assert bucket_keys(endpoint, bucket) == first  # same keys, same sizes
    assert {kind: store.read_table(kind).num_rows for kind in ("executions", "calls")} == rows


def bucket_etags(endpoint: str, bucket: str) -> dict[str, str]:
    """Every key with its ETag (the MD5 of its bytes here): any rewrite of an object shows."""
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    etags: dict[str, str] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        etags.update({obj["Key"]: obj["ETag"] for obj in page.get("Contents", [])})
    return etags


def test_sql_on_s3_is_read_only(s3_bucket, cli_env, capsys):
    """The views read the bucket through the registered s3fs filesystem, and nothing can write it."""
    import duckdb

    from cli.main import main

    endpoint, bucket = s3_bucket
    store_args = ["--data-root", f"s3://{bucket}/p", "--s3-endpoint-url", endpoint]
    assert main(["traj", "import", str(SAMPLE), *store_args]) == 0
    store = Store(StoreConfig(data_root=f"s3://{bucket}/p", s3_endpoint_url=endpoint))
    part = store.url(store.visible_parts("calls")[0])
    before = bucket_etags(endpoint, bucket)
    capsys.readouterr()

    copy = f"COPY (SELECT * FROM calls WHERE call_id = 0) TO '{part}' (FORMAT parquet, USE_TMP_FILE false)"
    assert main(["sql", *store_args, copy]) == 2
    assert "gyre sql is read-only: refused COPY" in capsys.readouterr().err
    con = connect(store, read_only=True)
    with pytest.raises(duckdb.PermissionException):
        con.execute(f"COPY (SELECT 1 AS a) TO 's3://{bucket}/p/elsewhere.parquet'")
    with pytest.raises(duckdb.PermissionException):
        con.execute(f"SELECT * FROM read_parquet('s3://{bucket}/p/campaigns/default/manifests/*')")

    assert bucket_etags(endpoint, bucket) == before
    assert con.execute("SELECT count(*) FROM training_tokens").fetchall()[0][0] > 0
    assert main(["sql", *store_args, "--format", "json", "SELECT count(*) AS n FROM calls"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": 55}]


def test_a_corrupt_part_on_s3_is_named_and_quarantined(s3_bucket, tmp_path):
    from trajectory_store.parts import check_parts, quarantine_parts
    from trajectory_store.storage import StoreError

    endpoint, bucket = s3_bucket
    store = Store(StoreConfig(data_root=f"s3://{bucket}/runs", s3_endpoint_url=endpoint, campaign="c1"))
    records = read_jsonl(SAMPLE)
    for step, problem in ((0, "p0"), (1, "p1")):
        path = tmp_path / f"{problem}.jsonl"
        path.write_text(
            "".join(json.dumps(r) + "\n" for r in records if r["execution_id"].startswith(problem))
        )
        assert import_jsonl(store, str(path), step).quarantined == 0
    [part] = [p for p in store.visible_parts("calls") if "/step=1/" in p]
    good = store.read_bytes(part)
    store.fs.pipe_file(part, good[:4] + b"\x17" * 296 + good[300:])  # garbage over the first page header

    with pytest.raises(StoreError, match="unreadable calls part") as raised:
        connect(store)
    assert store.url(part) in str(raised.value)
    with pytest.raises(StoreError, match="unreadable calls part") as raised:
        connect(store, steps=[1])  # a step's parts, fetched whole
    assert store.url(part) in str(raised.value)
    step_0 = connect(store, steps=[0]).sql("SELECT DISTINCT execution_id FROM calls ORDER BY 1").fetchall()
    assert step_0 == [("p0-e0",), ("p0-e1",)]  # another step's bad part is not read
    problems, counts = check_parts(store)
    assert [p.url for p in problems] == [store.url(part)] and counts["calls"] == 2

    [entry] = quarantine_parts(store, problems)

    keys = bucket_etags(endpoint, bucket)
    assert part.split("/", 1)[1] not in keys  # moved, so the views no longer read it
    moved = f"runs/campaigns/c1/{entry['moved_to']}"
    assert moved in keys and store.read_bytes(f"{bucket}/{moved}") == good[:4] + b"\x17" * 296 + good[300:]
    counts = (
        connect(store).sql("SELECT execution_id, count(*) FROM calls GROUP BY ALL ORDER BY ALL").fetchall()
    )
    assert counts == [("p0-e0", 13), ("p0-e1", 16)]
    assert check_parts(store)[0] == []
