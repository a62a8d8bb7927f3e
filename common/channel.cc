#include "common/channel.h"

#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace ubep {

std::shared_ptr<grpc::Channel> ControlChannel(const std::string& target, int max_receive_bytes) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kMaxReconnectBackoffMs);
  if (max_receive_bytes > 0) args.SetMaxReceiveMessageSize(max_receive_bytes);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

}  // namespace ubep
