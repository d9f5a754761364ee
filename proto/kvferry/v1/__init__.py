"""Generated gRPC/protobuf stubs for the kvferry v1 contract (see translate.proto; never edit by hand)."""
