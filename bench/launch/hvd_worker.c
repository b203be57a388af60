/* Trivial hvd worker for bench/launch.sh: publish this rank's address at the rendezvous, read every other
 * rank's (long-poll), exit. Plain HTTP/1.1 over a socket, as docs/rendezvous.md describes. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int request(const char *host, int port, const char *method, const char *path, const char *body,
                   const char *token, int rank) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {0};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    inet_pton(AF_INET, host, &addr.sin_addr);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) return -1;
    char req[1024];
    int n = snprintf(req, sizeof req,
                     "%s %s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nX-Hvd-Rank: %d\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n%s",
                     method, path, host, token, rank, strlen(body), body);
    if (write(fd, req, n) != n) return -1;
    char resp[2048];
    int got = 0, r;
    while ((r = read(fd, resp + got, sizeof resp - 1 - got)) > 0) got += r;
    resp[got] = 0;
    close(fd);
    int status = 0;
    sscanf(resp, "HTTP/1.1 %d", &status);
    return status;
}

int main(void) {
    const char *rdv = getenv("HVD_RENDEZVOUS"), *token = getenv("HVD_JOB_TOKEN");
    if (!rdv || !token) { fprintf(stderr, "not under hvd run\n"); return 2; }
    int rank = atoi(getenv("HVD_RANK")), size = atoi(getenv("HVD_SIZE"));
    char host[64];
    int port;
    const char *colon = strrchr(rdv, ':');
    snprintf(host, sizeof host, "%.*s", (int)(colon - rdv), rdv);
    port = atoi(colon + 1);
    char path[128], body[64];
    snprintf(path, sizeof path, "/kv/bench/addr.%d", rank);
    snprintf(body, sizeof body, "127.0.0.1:%d", 40000 + rank);
    if (request(host, port, "PUT", path, body, token, rank) != 200) return 1;
    for (int other = 0; other < size; other++) {
        snprintf(path, sizeof path, "/kv/bench/addr.%d?wait_ms=60000", other);
        if (request(host, port, "GET", path, "", token, rank) != 200) return 1;
    }
    return 0;
}
