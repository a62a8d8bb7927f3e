// HttpGet: a plain HTTP/1.0 GET to a port on loopback (for /metrics scrapes by ubep-local
// and the tests). Thread-safe.
#ifndef UBEP_COMMON_HTTP_GET_H_
#define UBEP_COMMON_HTTP_GET_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <string>

namespace ubep {

// Plain HTTP/1.0 GET on loopback; the body of a 200 answer read whole, or "" on failure:
// connecting, sending and each read give up after 5 s, and an answer of another status, cut
// short of its Content-Length, or ended by a read error is a failure (a cut exposition would
// read as a sample of a smaller value).
inline std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  timeval timeout{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  bool whole = false;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
        static_cast<ssize_t>(request.size())) {
      char buffer[8192];
      while (true) {
        const ssize_t n = read(fd, buffer, sizeof(buffer));
        if (n > 0) {
          response.append(buffer, static_cast<size_t>(n));
        } else if (n == 0) {
          whole = true;  // The server closed: the answer is all here.
          break;
        } else if (errno != EINTR) {
          break;  // A timeout or an error: what came may be cut short.
        }
      }
    }
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (!whole || body == std::string::npos) return "";
  const std::string head = response.substr(0, body);
  // "HTTP/1.x 200 ..."
  if (head.size() < 12 || head.compare(0, 5, "HTTP/") != 0 || head.compare(8, 4, " 200") != 0) {
    return "";
  }
  std::string text = response.substr(body + 4);
  // A Content-Length the body falls short of (or runs past): not this answer's body.
  for (size_t at = head.find("\r\n"); at != std::string::npos; at = head.find("\r\n", at + 2)) {
    const std::string line = head.substr(at + 2, head.find("\r\n", at + 2) - at - 2);
    constexpr char kLength[] = "content-length:";
    if (line.size() < sizeof(kLength) - 1) continue;
    std::string name = line.substr(0, sizeof(kLength) - 1);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (name != kLength) continue;
    const std::string value = line.substr(sizeof(kLength) - 1);
    char* end = nullptr;
    const unsigned long long length = std::strtoull(value.c_str(), &end, 10);
    if (end == value.c_str() || length != text.size()) return "";
  }
  return text;
}

}  // namespace ubep

#endif  // UBEP_COMMON_HTTP_GET_H_
