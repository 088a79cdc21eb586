-- Base views over the stored datasets. The connection factory (db.py) first defines
-- executions_raw / calls_raw / metrics_raw over the Parquet parts that committed manifests list
-- (a connection is a snapshot: the parts visible when it opened), plus the small config tables
-- selection_config, role_priority and trainable_statuses.

-- The geometry of every call, without its token lists, read once per connection: the tree and
-- selection views join on this small table and touch token lists only where they need tokens.
-- A call written twice (two flushes of the same rows) keeps one row.
CREATE OR REPLACE TEMP TABLE call_segments AS
SELECT
    execution_id,
    call_id,
    step,
    role,
    agent_id,
    parent_call_id,
    prefix_len AS seg_start,  -- the call owns the tokens at depths [seg_start, seg_end)
    prompt_len + output_len AS seg_end,  -- = prefix_len + len(new_ids): the sequence's length
    prompt_len,
    prompt_len + output_len AS seq_len,
    policy_version,
    context_hash,
    filename
FROM calls_raw
QUALIFY row_number() OVER (PARTITION BY execution_id, call_id ORDER BY step, filename) = 1;

-- Calls as stored (delta-encoded), one row per call.
CREATE OR REPLACE VIEW calls AS
SELECT r.* EXCLUDE (filename)
FROM calls_raw r
SEMI JOIN call_segments s ON s.execution_id = r.execution_id AND s.call_id = r.call_id AND s.filename = r.filename;

-- One row per execution; a re-recorded execution keeps its latest row.
CREATE OR REPLACE VIEW executions AS
SELECT * EXCLUDE (filename) FROM executions_raw
QUALIFY row_number() OVER (PARTITION BY execution_id ORDER BY step DESC, ended_at DESC NULLS LAST, filename) = 1;

CREATE OR REPLACE VIEW metrics AS SELECT * EXCLUDE (filename) FROM metrics_raw;
