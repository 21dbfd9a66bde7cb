"""Global batches assembled (`data_input`) from each process' share, read in
parts (`data_sources`, `loader_rows`, `pydataset_shares`) or by `tf_data`."""
