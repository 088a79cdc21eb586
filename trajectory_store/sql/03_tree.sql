-- The prefix-shared tree of each execution. Its trie nodes are tokens; tree_nodes are maximal runs
-- of tokens inside one call's own segment that are all policy or all context, cut wherever
-- another call branches off. A token is policy when it lies in the output of at least one call.
-- node_id = (owner call id << 32) | depth of the node's first token.

-- Output spans: call gen_call_id generated the tokens at depths [lo, hi) of owner's segment.
-- Usually an output lies in its own call's segment; when a call regenerated an opening that an
-- earlier call already had (a retry), the span reaches up into its ancestors' segments.
CREATE OR REPLACE VIEW policy_spans AS
WITH RECURSIVE up(execution_id, gen_call_id, owner, lo, hi) AS (
    SELECT execution_id, call_id, parent_call_id, prompt_len, seg_start
    FROM call_segments
    WHERE prompt_len < seg_start AND parent_call_id IS NOT NULL
    UNION ALL
    SELECT u.execution_id, u.gen_call_id, a.parent_call_id, u.lo, a.seg_start
    FROM up u
    JOIN call_segments a ON a.execution_id = u.execution_id AND a.call_id = u.owner
    WHERE u.lo < a.seg_start AND a.parent_call_id IS NOT NULL
)
SELECT execution_id, call_id AS gen_call_id, call_id AS owner, greatest(seg_start, prompt_len) AS lo, seg_end AS hi
FROM call_segments
WHERE seg_end > greatest(seg_start, prompt_len)
UNION ALL
SELECT u.execution_id, u.gen_call_id, u.owner, greatest(u.lo, a.seg_start) AS lo, u.hi
FROM up u
JOIN call_segments a ON a.execution_id = u.execution_id AND a.call_id = u.owner;

-- The nodes without their tokens (cheap: no token list is read).
CREATE OR REPLACE VIEW node_geometry AS
WITH cuts AS (
    SELECT execution_id, call_id AS owner, seg_start AS cut FROM call_segments WHERE seg_end > seg_start
    UNION
    SELECT execution_id, call_id, seg_end FROM call_segments WHERE seg_end > seg_start
    UNION  -- where children branch off
    SELECT execution_id, parent_call_id, seg_start FROM call_segments
    WHERE parent_call_id IS NOT NULL AND seg_end > seg_start
    UNION  -- where outputs begin and end
    SELECT execution_id, owner, lo FROM policy_spans
    UNION
    SELECT execution_id, owner, hi FROM policy_spans
),
runs AS (
    SELECT execution_id, owner, cut AS node_start,
           lead(cut) OVER (PARTITION BY execution_id, owner ORDER BY cut) AS node_end
    FROM cuts
),
nodes AS (
    SELECT r.execution_id, r.owner, r.node_start, r.node_end, s.seg_start, s.parent_call_id, s.role AS owner_role
    FROM runs r
    JOIN call_segments s ON s.execution_id = r.execution_id AND s.call_id = r.owner
    WHERE r.node_end IS NOT NULL
),
policy AS (
    SELECT n.execution_id, n.owner, n.node_start, min(p.gen_call_id) AS gen_call_id
    FROM nodes n
    JOIN policy_spans p
      ON p.execution_id = n.execution_id AND p.owner = n.owner AND p.lo <= n.node_start AND p.hi >= n.node_end
    GROUP BY ALL
)
SELECT
    n.execution_id,
    (n.owner::BIGINT << 32) | n.node_start AS node_id,
    CASE
        WHEN n.node_start > n.seg_start
            THEN (n.owner::BIGINT << 32) | lag(n.node_start) OVER (PARTITION BY n.execution_id, n.owner ORDER BY n.node_start)
        WHEN n.parent_call_id IS NOT NULL
            THEN (n.parent_call_id::BIGINT << 32) | pn.node_start
    END AS parent_node_id,
    n.node_start::BIGINT AS depth,
    (n.node_end - n.node_start)::BIGINT AS n_tokens,
    p.gen_call_id IS NOT NULL AS is_policy,
    p.gen_call_id AS call_id,
    coalesce(g.role, n.owner_role) AS role,
    n.owner AS owner_call_id,
    n.seg_start AS owner_seg_start
FROM nodes n
LEFT JOIN policy p USING (execution_id, owner, node_start)
LEFT JOIN call_segments g ON g.execution_id = n.execution_id AND g.call_id = p.gen_call_id
-- the parent's node that ends where this call branched off
LEFT JOIN runs pn
  ON n.node_start = n.seg_start AND pn.execution_id = n.execution_id AND pn.owner = n.parent_call_id
 AND pn.node_end = n.seg_start;

-- The nodes with their token ids.
CREATE OR REPLACE VIEW tree_nodes AS
SELECT
    n.execution_id,
    n.node_id,
    n.parent_node_id,
    n.depth,
    n.n_tokens,
    list_slice(c.new_ids, n.depth - n.owner_seg_start + 1, n.depth - n.owner_seg_start + n.n_tokens) AS token_ids,
    n.is_policy,
    n.call_id,
    n.role,
    n.owner_call_id
FROM node_geometry n
JOIN calls c ON c.execution_id = n.execution_id AND c.call_id = n.owner_call_id;
