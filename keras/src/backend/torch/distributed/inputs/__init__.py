"""Input: global batches from each process' share of the data.

- `data_input`: global batches assembled from each process' rows.
- `data_sources`: `DataLoader`s and `PyDataset`s read one process' share.
- `data_parts`, `loader_rows`, `pydataset_shares`: which part each
  process reads.
- `tf_data`: `tf.data` input.
"""
