"""The node's supervisor: `supervisor` (the lease, the attempts, the restart policy), `attempt`
(one trainer process: its plan, spawn, events, signals, how it ended), `durability` (restoring
and uploading checkpoints, what is durable), `runspec` (what a supervisor is given and returns),
`threads` (the trainer's CPU threads), `diskfull` (the failure a restart cannot help)."""
