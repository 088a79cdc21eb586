-- The exact prompt of every call, rebuilt from the delta encoding by walking parent pointers.
-- Rebuilt on demand: filter by execution_id / call_id when you only need a few.
CREATE OR REPLACE VIEW call_prompts AS
WITH RECURSIVE chain(execution_id, call_id, owner, upto) AS (
    SELECT execution_id, call_id, call_id, seg_end FROM call_segments
    UNION ALL
    SELECT ch.execution_id, ch.call_id, s.parent_call_id, s.seg_start
    FROM chain ch
    JOIN call_segments s ON s.execution_id = ch.execution_id AND s.call_id = ch.owner
    WHERE s.parent_call_id IS NOT NULL
),
pieces AS (
    SELECT ch.execution_id, ch.call_id, c.prefix_len AS seg_start,
           list_slice(c.new_ids, 1, ch.upto - c.prefix_len) AS piece
    FROM chain ch
    JOIN calls c ON c.execution_id = ch.execution_id AND c.call_id = ch.owner
)
SELECT
    p.execution_id,
    p.call_id,
    list_slice(flatten(list(p.piece ORDER BY p.seg_start)), 1, any_value(s.prompt_len)) AS prompt_ids,
    any_value(s.context_hash) AS context_hash
FROM pieces p
JOIN call_segments s ON s.execution_id = p.execution_id AND s.call_id = p.call_id
GROUP BY p.execution_id, p.call_id;
