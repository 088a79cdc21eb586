-- Role-priority selection: per execution, at most j_max trajectories; roles in role_priority order
-- (default main > sub > main_summary > sub_summary; roles not listed are never selected); within a
-- role, a weighted sample without replacement in proportion to policy tokens (Efraimidis-Spirakis
-- keys ln(u)/w from a seeded md5, so the same seed always selects the same trajectories).
-- Only executions whose status is trainable (trainable_statuses) are selected.
CREATE OR REPLACE VIEW selected_trajectories AS
WITH candidates AS (
    SELECT
        t.*,
        rp.priority,
        ln((('0x' || substr(md5(concat_ws(':', cfg.seed, t.execution_id, t.trajectory_id)), 1, 13))::UBIGINT + 0.5)
           / 4503599627370496.0) / t.n_policy_tokens AS sample_key,
        cfg.j_max
    FROM trajectories t
    JOIN role_priority rp ON rp.role = t.role
    JOIN executions e ON e.execution_id = t.execution_id
    JOIN trainable_statuses ts ON ts.status = e.status
    CROSS JOIN selection_config cfg
    WHERE t.n_policy_tokens > 0
),
ranked AS (
    SELECT *, row_number() OVER (
        PARTITION BY execution_id ORDER BY priority, sample_key DESC, trajectory_id) AS rank
    FROM candidates
)
SELECT execution_id, trajectory_id, leaf_node_id, role, agent_id, n_tokens, n_policy_tokens, rank
FROM ranked
WHERE rank <= j_max;

-- The training tree of each execution: the union of its selected trajectories' nodes (tree_nodes
-- rows, with the behaviour logprobs of their policy tokens).
CREATE OR REPLACE VIEW training_nodes AS
WITH RECURSIVE chain(execution_id, owner, upto) AS (
    SELECT s.execution_id, s.trajectory_id, c.seg_end
    FROM selected_trajectories s
    JOIN call_segments c ON c.execution_id = s.execution_id AND c.call_id = s.trajectory_id
    UNION ALL
    SELECT ch.execution_id, c.parent_call_id, c.seg_start
    FROM chain ch
    JOIN call_segments c ON c.execution_id = ch.execution_id AND c.call_id = ch.owner
    WHERE c.parent_call_id IS NOT NULL
),
reach AS (SELECT execution_id, owner, max(upto) AS upto FROM chain GROUP BY ALL),
nodes AS (
    SELECT n.*
    FROM tree_nodes n
    JOIN reach r ON r.execution_id = n.execution_id AND r.owner = n.owner_call_id AND n.depth + n.n_tokens <= r.upto
)
SELECT
    n.* EXCLUDE (owner_call_id),
    CASE WHEN n.is_policy
        THEN list_slice(g.output_logprobs, n.depth - g.prompt_len + 1, n.depth - g.prompt_len + n.n_tokens)
    END AS behaviour_logprobs,
    g.policy_version
FROM nodes n
LEFT JOIN calls g ON g.execution_id = n.execution_id AND g.call_id = n.call_id;

-- One row per policy token to train; weights sum to 1 per execution.
CREATE OR REPLACE VIEW training_tokens AS
SELECT
    execution_id,
    node_id,
    generate_subscripts(token_ids, 1) - 1 AS offset,
    unnest(token_ids) AS token_id,
    unnest(behaviour_logprobs) AS behaviour_logprob,
    1.0 / sum(n_tokens) OVER (PARTITION BY execution_id) AS weight
FROM training_nodes
WHERE is_policy;
