"""``python -m dniasync.data``: the data set converter's command line (the code lives in :mod:`dniasync.train.data`)."""
