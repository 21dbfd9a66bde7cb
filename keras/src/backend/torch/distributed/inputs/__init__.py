"""Global batches assembled (`data_input`) from each process' share, read by
`data_sources` and `tf_data` and picked by `data_parts`, `loader_rows` and
`pydataset_shares`."""
