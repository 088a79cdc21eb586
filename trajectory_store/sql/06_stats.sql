-- Per-execution figures for `gyre traj stats`. bytes_stored: the Arrow bytes of the execution's
-- call rows before Parquet compression (token ids and logprobs at 4 bytes each, list offsets,
-- fixed-width columns and strings).
CREATE OR REPLACE VIEW execution_stats AS
WITH c AS (
    SELECT
        execution_id,
        count(*) AS n_calls,
        sum(prompt_len + output_len)::BIGINT AS n_naive_tokens,
        sum(len(new_ids))::BIGINT AS n_unique_tokens,
        -- 79 fixed bytes a row: 7 int32 columns, 2 float64, int16, bool, 2 list and 6 string offsets
        sum(4 * len(new_ids) + 4 * len(output_logprobs) + 79
            + strlen(execution_id) + strlen(coalesce(agent_id, '')) + strlen(role)
            + strlen(coalesce(engine_id, '')) + strlen(context_hash) + strlen(coalesce(finish_reason, '')))
            ::BIGINT AS bytes_stored
    FROM calls GROUP BY execution_id
),
p AS (SELECT execution_id, sum(n_tokens) FILTER (WHERE is_policy)::BIGINT AS n_policy_tokens FROM node_geometry GROUP BY ALL),
t AS (SELECT execution_id, count(*) AS n_trajectories FROM trajectories GROUP BY ALL),
s AS (SELECT execution_id, count(*) AS n_selected FROM selected_trajectories GROUP BY ALL)
SELECT
    c.execution_id,
    e.status,
    e.reward,
    c.n_calls,
    c.n_naive_tokens,
    c.n_unique_tokens,
    coalesce(p.n_policy_tokens, 0) AS n_policy_tokens,
    coalesce(t.n_trajectories, 0) AS n_trajectories,
    coalesce(s.n_selected, 0) AS n_selected,
    c.bytes_stored
FROM c
LEFT JOIN executions e USING (execution_id)
LEFT JOIN p USING (execution_id)
LEFT JOIN t USING (execution_id)
LEFT JOIN s USING (execution_id)
ORDER BY c.execution_id;
