"""Generated protobuf/gRPC modules for protos/afd/v1/*.proto (built, never committed).

Call afd.protos.ensure_generated() before importing one. Each generated module is imported by
the one module that converts its messages (ffn: afd.wire and afd.transport.grpc).
"""
