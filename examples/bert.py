"""BERT pretraining across mixed GPUs: see examples/apps/bert/train.py, or run with --help."""

from apps.bert.train import main

if __name__ == "__main__":
    main()
