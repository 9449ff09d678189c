"""The job verbs, one room each: finding a job and its record (find), applying and running one
(run, with the preflight's checks and the stored job files: preflight, envfiles, stored),
submitting it to storage (submit), the queue a node serves (queue), cancel and delete (cancel),
and exporting its weights (export). The CLI (runner/cli) and the Python API print what they return."""
