// HMAC-SHA256 and a constant-time comparison for the native data plane's authenticated
// handshake (dataplane_auth.h), from OpenSSL's libcrypto: a vetted implementation, loaded at
// run time with dlopen (as libucp is for UCX, dataplane_ucx.cc), so _core builds and imports
// without OpenSSL's headers and a job without a secret never needs the library.
// tests/unit/test_crypto.py checks RFC 4231's vectors and the error where it is missing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace bps {

// Whether libcrypto is loaded (loading it on the first call); false and *err naming the
// library and the package to install when it cannot be.
bool crypto_available(std::string* err);
// Throws std::runtime_error with crypto_available's message when libcrypto is missing: what
// a data server or client with a job secret calls before it starts.
void require_crypto();
// HMAC-SHA256 (RFC 2104) of msg under key; throws std::runtime_error when libcrypto is missing.
void hmac_sha256(const void* key, std::size_t key_len, const void* msg, std::size_t msg_len,
                 std::uint8_t out[32]);
// Constant-time comparison of n bytes.
bool equal_ct(const std::uint8_t* a, const std::uint8_t* b, std::size_t n);
// Testing hook: forget the loaded library and try `names` (':'-separated sonames or paths)
// from now on; empty restores the default list. Returns the previous list.
std::string crypto_set_names(const std::string& names);

}  // namespace bps
