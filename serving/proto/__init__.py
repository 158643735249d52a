"""The serving API's protocol buffers: `dsv4_serving.proto` and the Python code generated from it
(`dsv4_serving_pb2*.py`, committed; regenerate with `python -m serving.proto.regenerate`)."""
