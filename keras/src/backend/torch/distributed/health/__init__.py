"""The job's health: nothing hangs, a failure names its process.

- `health`: collectives bounded by timeouts; a failed, dead or frozen
  process reported by name instead of a transport error.
- `agreement`: processes that disagree (model, number of batches) stopped
  with a `ValueError` before they can hang.
- `call_agreement`: collective calls made on one process (reading a sharded
  value, `fit`, saving) agreed in the job's store first.
"""
