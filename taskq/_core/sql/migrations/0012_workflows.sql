-- Workflows: chains and groups of tasks, each next step staged through the outbox in the transaction that
-- records the end of the step (or member) that finishes the one before (issue 23).
CREATE TABLE IF NOT EXISTS taskq_workflows (
    namespace    text NOT NULL,
    workflow_id  text NOT NULL,
    state        text NOT NULL DEFAULT 'running'
                 CHECK (state IN ('running', 'completed', 'failed', 'cancelled')),
    cancelled    boolean NOT NULL DEFAULT false,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at     timestamptz,
    PRIMARY KEY (workflow_id, namespace)
);

-- One row per node of a workflow's tree: a task, a chain or a group. A task's row holds its record, encoded
-- and validated when the workflow was enqueued, to be staged in the outbox when its turn comes.
CREATE TABLE IF NOT EXISTS taskq_workflow_nodes (
    namespace        text NOT NULL,
    workflow_id      text NOT NULL,
    node             integer NOT NULL,  -- numbered in preorder: a node's subtree is the nodes node..last
    step             text NOT NULL,  -- '<workflow id>:<node>', a task's workflow header
    last             integer NOT NULL,
    parent           integer,  -- NULL for the root
    position         integer NOT NULL,  -- among its parent's children, from 0; a group's callback is -1
    kind             text NOT NULL CHECK (kind IN ('task', 'chain', 'group')),
    on_failure       text CHECK (on_failure IN ('run', 'skip')),  -- groups
    state            text NOT NULL DEFAULT 'waiting'
                     CHECK (state IN ('waiting', 'running', 'completed', 'dead', 'cancelled', 'skipped')),
    fired            boolean NOT NULL DEFAULT false,  -- a group whose members all ended, decided once
    task_id          text,
    idempotency_key  text,
    task_type        text,
    topic            text,
    key              bytea,
    value            bytea,
    headers          jsonb,
    result_key       text,  -- the idempotency key whose record holds the node's result
    ended_at         timestamptz,
    PRIMARY KEY (workflow_id, namespace, node)
);
-- A batch of nodes is found by their steps, `step = ANY(...)` one probe each whatever the statistics (a
-- batch on the primary key's last column was planned as a scan of the workflow's nodes).
CREATE UNIQUE INDEX IF NOT EXISTS taskq_workflow_nodes_step ON taskq_workflow_nodes (step, namespace);
-- Ending a node is a HOT update (none of the columns it writes is indexed, and pages keep room for the new
-- versions): the way in is the primary key, a group's members being a range of it.
ALTER TABLE taskq_workflow_nodes SET (fillfactor = 70);
