"""Where the loop's numbers go. One concern per file:

report.py    the console (a progress bar on a terminal), metrics.jsonl, events, the end-of-run summary
metrics.py   FLOPs and MFU accounting, the JSONL log, the Prometheus exporter's gauges
steplog.py   the numbers each step leaves on the device, read on the host only now and then
trackers.py  TensorBoard, MLflow and W&B, fed the records of metrics.jsonl
"""
