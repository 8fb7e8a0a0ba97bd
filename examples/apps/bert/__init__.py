"""BERT pretraining across mixed GPUs, on hsync.WeightedDDP and hsync.Balancer: examples/bert.py runs
train.main(). config (flags), data (corpus, WordPiece, examples, batches), model (the network, its loss
and evaluation, the final export), train (the loop), report (the log), checkpoint (resume)."""
