// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the native data plane's authenticated
// handshake. Checked against Python's hashlib/hmac in tests/kernels/test_sha256.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace bps {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, std::size_t n);
  void final(std::uint8_t out[32]);

 private:
  void block(const std::uint8_t* p);
  std::uint32_t h_[8];
  std::uint8_t buf_[64];
  std::size_t used_ = 0;
  std::uint64_t total_ = 0;
};

void sha256(const void* data, std::size_t n, std::uint8_t out[32]);
void hmac_sha256(const void* key, std::size_t key_len, const void* msg, std::size_t msg_len,
                 std::uint8_t out[32]);
// Constant-time comparison of n bytes.
bool equal_ct(const std::uint8_t* a, const std::uint8_t* b, std::size_t n);

}  // namespace bps
