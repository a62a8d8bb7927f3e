#include "common/rpc_origin.h"

#include <utility>

namespace ubep {
namespace {

using grpc::experimental::InterceptionHookPoints;

class MarkOwnErrors final : public grpc::experimental::Interceptor {
 public:
  explicit MarkOwnErrors(const std::string* origin) : origin_(origin) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    // The status a handler returns passes here on its way out; the transport's failures never
    // reach a handler, so they pass no interceptor of this server.
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS) &&
        !methods->GetSendStatus().ok()) {
      methods->GetSendTrailingMetadata()->emplace(kUbepOrigin, *origin_);
    }
    methods->Proceed();
  }

 private:
  const std::string* origin_;  // The factory's, which outlives the server's calls.
};

class MarkOwnErrorsFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit MarkOwnErrorsFactory(std::string origin) : origin_(std::move(origin)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo*) override {
    return new MarkOwnErrors(&origin_);
  }

 private:
  const std::string origin_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MarkOwnErrorsAs(
    std::string origin) {
  return std::make_unique<MarkOwnErrorsFactory>(std::move(origin));
}

}  // namespace ubep
