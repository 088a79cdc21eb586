-- Workspace snapshots (trajectory_store/snapshots.py): what timed-out executions left behind, what
-- completed ones ended with (when DispatchConfig.snapshot_completed is on), and each problem's
-- starting workspace (source = 'template'), one row per file, folder and symlink; file contents
-- live once each in blobs, keyed by sha256.

-- Contents, one row per sha256 (a blob written twice, by two writers at once, keeps one row).
CREATE OR REPLACE VIEW blobs AS
SELECT sha256, size, data, schema_version FROM blobs_raw
QUALIFY row_number() OVER (PARTITION BY sha256 ORDER BY filename) = 1;

-- The entries of one snapshot per execution (the one its executions row names; otherwise its
-- latest), and every template once.
CREATE OR REPLACE VIEW snapshots AS
WITH heads AS (
    SELECT DISTINCT execution_id, step, filename FROM snapshots_raw WHERE execution_id IS NOT NULL
),
chosen AS (
    SELECT h.filename
    FROM heads h LEFT JOIN executions e USING (execution_id)
    QUALIFY row_number() OVER (
        PARTITION BY h.execution_id
        ORDER BY (h.filename = e.snapshot_uri) DESC NULLS LAST, h.step DESC, h.filename DESC
    ) = 1
)
SELECT r.* EXCLUDE (filename)
FROM snapshots_raw r SEMI JOIN chosen c ON c.filename = r.filename
WHERE r.execution_id IS NOT NULL
UNION ALL
SELECT * EXCLUDE (filename) FROM snapshots_raw WHERE execution_id IS NULL
QUALIFY row_number() OVER (PARTITION BY problem_id, snapshot_id, path ORDER BY step, filename) = 1;

-- The rows with their content as text where it is valid UTF-8 and at most 64 KiB (else NULL).
CREATE OR REPLACE VIEW snapshot_files AS
SELECT
    s.execution_id,
    s.problem_id,
    s.step,
    s.source,
    s.path,
    s.kind,
    s.mode,
    s.size,
    s.sha256,
    s.link_target,
    CASE WHEN s.kind = 'file' AND s.size <= 65536 THEN try(decode(b.data)) END AS text,
    s.snapshot_id,
    s.template_id
FROM snapshots s
LEFT JOIN blobs b ON b.sha256 = s.sha256 AND s.kind = 'file' AND s.size <= 65536;

-- Each entry of an execution's snapshot against the problem's starting workspace: added, changed
-- (content, kind, mode or link target), removed (in the template, gone from the workspace),
-- unchanged. A snapshot stored without a template has every entry 'added'.
CREATE OR REPLACE VIEW snapshot_changes AS
WITH s AS (SELECT * FROM snapshots WHERE source <> 'template'),
t AS (
    SELECT DISTINCT snapshot_id, path, kind, mode, size, sha256, link_target
    FROM snapshots WHERE source = 'template'
),
heads AS (SELECT DISTINCT execution_id, problem_id, step, source, snapshot_id, template_id FROM s),
paths AS (
    SELECT execution_id, path FROM s
    UNION
    SELECT h.execution_id, t.path FROM heads h JOIN t ON t.snapshot_id = h.template_id
)
SELECT
    h.execution_id,
    h.problem_id,
    h.step,
    h.source,
    p.path,
    CASE
        WHEN t.path IS NULL THEN 'added'
        WHEN s.path IS NULL THEN 'removed'
        WHEN s.kind = t.kind AND s.mode = t.mode AND s.sha256 IS NOT DISTINCT FROM t.sha256
             AND s.link_target IS NOT DISTINCT FROM t.link_target THEN 'unchanged'
        ELSE 'changed'
    END AS change,
    coalesce(s.kind, t.kind) AS kind,
    s.size,
    t.size AS template_size,
    s.sha256,
    t.sha256 AS template_sha256
FROM paths p
JOIN heads h USING (execution_id)
LEFT JOIN s ON s.execution_id = p.execution_id AND s.path = p.path
LEFT JOIN t ON t.snapshot_id = h.template_id AND t.path = p.path;
