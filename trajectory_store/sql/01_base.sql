-- Base views over the stored datasets. The connection factory (db.py) first defines
-- executions_raw / calls_raw / metrics_raw over the Parquet parts that committed manifests list,
-- plus the small config tables selection_config, role_priority and trainable_statuses.

-- One row per execution; a re-recorded execution keeps its latest row.
CREATE OR REPLACE VIEW executions AS
SELECT * FROM executions_raw
QUALIFY row_number() OVER (PARTITION BY execution_id ORDER BY step DESC, ended_at DESC NULLS LAST) = 1;

-- Calls as stored (delta-encoded); a call written twice appears once.
CREATE OR REPLACE VIEW calls AS
SELECT * FROM calls_raw
QUALIFY row_number() OVER (PARTITION BY execution_id, call_id ORDER BY step) = 1;

CREATE OR REPLACE VIEW metrics AS SELECT * FROM metrics_raw;

-- Geometry of each call's own segment: the tokens at depths [seg_start, seg_end) it added.
CREATE OR REPLACE VIEW call_segments AS
SELECT
    execution_id,
    call_id,
    role,
    agent_id,
    parent_call_id,
    prefix_len AS seg_start,
    prefix_len + len(new_ids) AS seg_end,
    prompt_len,
    prompt_len + output_len AS seq_len,
    new_ids,
    output_logprobs,
    policy_version
FROM calls;
