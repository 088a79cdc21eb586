-- Trajectories: root-to-leaf paths of the tree. A leaf ends a call's own segment where no other
-- call continues; the trajectory takes that call's id and role (its whole sequence is the path).

-- Policy tokens on the path above each call: what its parent's path holds before the branch point.
CREATE OR REPLACE VIEW call_path_policy AS
WITH RECURSIVE
node_cum AS (
    SELECT execution_id, owner_call_id, depth + n_tokens AS node_end,
           sum(CASE WHEN is_policy THEN n_tokens ELSE 0 END)
               OVER (PARTITION BY execution_id, owner_call_id ORDER BY depth)::BIGINT AS cum_policy
    FROM node_geometry
),
base(execution_id, call_id, policy_above) AS (
    SELECT execution_id, call_id, 0::BIGINT FROM call_segments WHERE parent_call_id IS NULL
    UNION ALL
    SELECT c.execution_id, c.call_id, b.policy_above + coalesce(n.cum_policy, 0)::BIGINT
    FROM base b
    JOIN call_segments c ON c.execution_id = b.execution_id AND c.parent_call_id = b.call_id
    LEFT JOIN node_cum n
      ON n.execution_id = c.execution_id AND n.owner_call_id = b.call_id AND n.node_end = c.seg_start
)
SELECT b.execution_id, b.call_id, b.policy_above,
       b.policy_above + coalesce((SELECT max(n.cum_policy) FROM node_cum n
                                  WHERE n.execution_id = b.execution_id AND n.owner_call_id = b.call_id), 0)
           AS policy_through_end
FROM base b;

CREATE OR REPLACE VIEW trajectories AS
SELECT
    s.execution_id,
    s.call_id AS trajectory_id,
    (s.call_id::BIGINT << 32) | max(n.depth) AS leaf_node_id,
    s.role,
    s.agent_id,
    s.seg_end AS n_tokens,
    any_value(cp.policy_through_end)::BIGINT AS n_policy_tokens
FROM call_segments s
JOIN node_geometry n ON n.execution_id = s.execution_id AND n.owner_call_id = s.call_id
JOIN call_path_policy cp ON cp.execution_id = s.execution_id AND cp.call_id = s.call_id
WHERE s.seg_end > s.seg_start
  AND NOT EXISTS (
      SELECT 1 FROM call_segments c
      WHERE c.execution_id = s.execution_id AND c.parent_call_id = s.call_id
        AND c.seg_start = s.seg_end AND c.seg_end > c.seg_start
  )
GROUP BY s.execution_id, s.call_id, s.role, s.agent_id, s.seg_end;
