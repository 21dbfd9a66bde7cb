"""Input: global batches assembled from each process' share of the data.

`data_input` assembles them; `data_sources` reads one process' share of
`DataLoader`s and `PyDataset`s; `data_parts`, `loader_rows` and
`pydataset_shares` pick which part each process reads; `tf_data` reads
`tf.data` input.
"""
