"""The job's health: nothing hangs, a failure names its process. `health`:
timeouts on collectives, a failed or frozen process reported by name;
`agreement`: disagreeing processes (model, batch count) stopped before they
hang; `call_agreement`: collective calls made on one process agreed first.
"""
