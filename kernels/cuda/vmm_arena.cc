#include "kernels/cuda/vmm_arena.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/scoped_device.h"

namespace ubep::kernels {
namespace {

// The driver API functions this file uses, resolved once through the runtime.
struct Driver {
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                         unsigned long long) = nullptr;
  CUresult (*mem_release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                              unsigned long long) = nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                  unsigned long long) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                            unsigned long long) = nullptr;
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*,
                            CUmemAllocationHandleType) = nullptr;
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*,
                          CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*device_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*memset_d8)(CUdeviceptr, unsigned char, size_t) = nullptr;
  absl::Status status;
};

template <typename Fn>
absl::Status Resolve(const char* symbol, Fn& fn) {
  void* pointer = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t e =
      cudaGetDriverEntryPointByVersion(symbol, &pointer, 12000, cudaEnableDefault, &found);
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || pointer == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA driver entry point ", symbol, " is not available (",
                     cudaGetErrorString(e), "); is an NVIDIA driver installed?"));
  }
  fn = reinterpret_cast<Fn>(pointer);
  return absl::OkStatus();
}

const Driver& GetDriver() {
  static const Driver* driver = [] {
    auto* d = new Driver;
    const std::pair<const char*, absl::Status> results[] = {
        {"cuMemCreate", Resolve("cuMemCreate", d->mem_create)},
        {"cuMemRelease", Resolve("cuMemRelease", d->mem_release)},
        {"cuMemAddressReserve", Resolve("cuMemAddressReserve", d->address_reserve)},
        {"cuMemAddressFree", Resolve("cuMemAddressFree", d->address_free)},
        {"cuMemMap", Resolve("cuMemMap", d->map)},
        {"cuMemUnmap", Resolve("cuMemUnmap", d->unmap)},
        {"cuMemSetAccess", Resolve("cuMemSetAccess", d->set_access)},
        {"cuMemExportToShareableHandle", Resolve("cuMemExportToShareableHandle", d->export_handle)},
        {"cuMemImportFromShareableHandle",
         Resolve("cuMemImportFromShareableHandle", d->import_handle)},
        {"cuMemGetAllocationGranularity", Resolve("cuMemGetAllocationGranularity", d->granularity)},
        {"cuDeviceGetAttribute", Resolve("cuDeviceGetAttribute", d->device_attribute)},
        {"cuMemsetD8", Resolve("cuMemsetD8", d->memset_d8)},
    };
    for (const auto& [name, status] : results) {
      if (!status.ok() && d->status.ok()) d->status = status;
    }
    return d;
  }();
  return *driver;
}

absl::Status Check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, " failed: CUDA driver error ", static_cast<int>(r)));
}

CUmemAllocationProp Prop(int device, VmmArena::Sharing sharing) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = sharing == VmmArena::Sharing::kFabric
                                  ? CU_MEM_HANDLE_TYPE_FABRIC
                                  : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

absl::StatusOr<size_t> RoundUp(int device, VmmArena::Sharing sharing, size_t bytes) {
  const Driver& d = GetDriver();
  const CUmemAllocationProp prop = Prop(device, sharing);
  size_t granularity = 0;
  if (absl::Status s = Check(d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                             "cuMemGetAllocationGranularity");
      !s.ok()) {
    return s;
  }
  return (bytes + granularity - 1) / granularity * granularity;
}

}  // namespace

bool VmmArena::FabricSupported(int device) {
  const Driver& d = GetDriver();
  if (!d.status.ok()) return false;
  int supported = 0;
  return d.device_attribute(&supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
                            device) == CUDA_SUCCESS &&
         supported != 0;
}

absl::Status VmmArena::MapHere(int device, const std::vector<int>& peers) {
  const Driver& d = GetDriver();
  CUdeviceptr address = 0;
  if (absl::Status s = Check(d.address_reserve(&address, size_, 0, 0, 0), "cuMemAddressReserve");
      !s.ok()) {
    return s;
  }
  address_ = address;
  if (absl::Status s = Check(d.map(address, size_, 0, handle_, 0), "cuMemMap"); !s.ok()) {
    d.address_free(address, size_);
    address_ = 0;
    return s;
  }
  std::vector<CUmemAccessDesc> access;
  std::vector<int> devices = {device};
  devices.insert(devices.end(), peers.begin(), peers.end());
  for (int dev : devices) {
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = dev;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    access.push_back(a);
  }
  return Check(d.set_access(address, size_, access.data(), access.size()), "cuMemSetAccess");
}

absl::StatusOr<std::unique_ptr<VmmArena>> VmmArena::Create(int device, size_t bytes,
                                                           Sharing sharing,
                                                           const std::vector<int>& peers) {
  const Driver& d = GetDriver();
  if (!d.status.ok()) return d.status;
  // The caller's current device is put back on return (the arena is placed by `device`).
  const ScopedDevice on_device(device);
  if (!on_device.status().ok()) {
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device ", device));
  }
  cudaFree(nullptr);  // Creates the device's primary context.
  if (sharing == Sharing::kFabric && !FabricSupported(device)) {
    return absl::FailedPreconditionError(
        absl::StrCat("device ", device, " does not support fabric handles (no multi-node NVLink)"));
  }
  absl::StatusOr<size_t> size = RoundUp(device, sharing, bytes);
  if (!size.ok()) return size.status();
  std::unique_ptr<VmmArena> arena(new VmmArena);
  arena->size_ = *size;
  arena->sharing_ = sharing;
  const CUmemAllocationProp prop = Prop(device, sharing);
  CUmemGenericAllocationHandle handle = 0;
  if (absl::Status s = Check(d.mem_create(&handle, arena->size_, &prop, 0), "cuMemCreate"); !s.ok()) {
    return s;
  }
  arena->handle_ = handle;
  if (absl::Status s = arena->MapHere(device, peers); !s.ok()) return s;
  if (absl::Status s = Check(d.memset_d8(arena->address_, 0, arena->size_), "cuMemsetD8"); !s.ok()) {
    return s;
  }
  // cuMemsetD8 may return before the memory is set: the arena is zero before anyone (another
  // process, through the exported fd) reads its epoch flags.
  if (const cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaDeviceSynchronize after zeroing the arena: ", cudaGetErrorString(e)));
  }
  return arena;
}

absl::StatusOr<std::unique_ptr<VmmArena>> VmmArena::Import(int device, size_t bytes,
                                                           Sharing sharing, void* os_handle) {
  const Driver& d = GetDriver();
  if (!d.status.ok()) return d.status;
  // The caller's current device is put back on return (the arena is placed by `device`).
  const ScopedDevice on_device(device);
  if (!on_device.status().ok()) {
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device ", device));
  }
  cudaFree(nullptr);  // Creates the device's primary context.
  absl::StatusOr<size_t> size = RoundUp(device, sharing, bytes);
  if (!size.ok()) return size.status();
  std::unique_ptr<VmmArena> arena(new VmmArena);
  arena->size_ = *size;
  arena->sharing_ = sharing;
  CUmemGenericAllocationHandle handle = 0;
  if (absl::Status s = Check(d.import_handle(&handle, os_handle,
                                             sharing == Sharing::kFabric
                                                 ? CU_MEM_HANDLE_TYPE_FABRIC
                                                 : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                             "cuMemImportFromShareableHandle");
      !s.ok()) {
    return s;
  }
  arena->handle_ = handle;
  if (absl::Status s = arena->MapHere(device, {}); !s.ok()) return s;
  return arena;
}

absl::StatusOr<std::unique_ptr<VmmArena>> VmmArena::ImportFd(int device, int fd, size_t bytes) {
  return Import(device, bytes, Sharing::kPosixFd,
                reinterpret_cast<void*>(static_cast<intptr_t>(fd)));
}

absl::StatusOr<std::unique_ptr<VmmArena>> VmmArena::ImportFabric(int device,
                                                                 const FabricHandle& fabric,
                                                                 size_t bytes) {
  CUmemFabricHandle h;
  std::memcpy(&h, fabric.data(), sizeof(h));
  return Import(device, bytes, Sharing::kFabric, &h);
}

VmmArena::~VmmArena() {
  const Driver& d = GetDriver();
  if (!d.status.ok()) return;
  if (address_ != 0) {
    d.unmap(address_, size_);
    d.address_free(address_, size_);
  }
  if (handle_ != 0) d.mem_release(handle_);
}

absl::StatusOr<int> VmmArena::ExportFd() const {
  if (sharing_ != Sharing::kPosixFd) {
    return absl::FailedPreconditionError("a fabric-handle arena has no fd; use ExportFabric");
  }
  int fd = -1;
  if (absl::Status s = Check(GetDriver().export_handle(&fd, handle_,
                                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                             "cuMemExportToShareableHandle");
      !s.ok()) {
    return s;
  }
  return fd;
}

absl::StatusOr<FabricHandle> VmmArena::ExportFabric() const {
  if (sharing_ != Sharing::kFabric) {
    return absl::FailedPreconditionError("this arena was not created for fabric sharing");
  }
  CUmemFabricHandle h;
  if (absl::Status s = Check(GetDriver().export_handle(&h, handle_, CU_MEM_HANDLE_TYPE_FABRIC, 0),
                             "cuMemExportToShareableHandle");
      !s.ok()) {
    return s;
  }
  FabricHandle out;
  std::memcpy(out.data(), &h, out.size());
  return out;
}

}  // namespace ubep::kernels
