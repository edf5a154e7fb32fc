/* The load generator of `make overload` (tools/overload.py): `users` virtual
 * users, each on its own keep-alive HTTP/1.1 connection to Triton's
 * POST /v2/models/<model>/infer (binary tensor extension: IMAGE, and a PROMPT
 * that is new for every request, so the describe step's cache never answers).
 * A user waits for its answer; on a refusal (HTTP 503 whose body says
 * "Exceeds maximum queue size" or "Request timeout expired", Triton's queue policy, or "in-flight limit",
 * the shedding proxy in deploy/nginx) it backs off as classify_describe's
 * clients do (exponential with full jitter, capped at 5 s; at least the
 * Retry-After, capped at 60 s) and sends again; with BACKOFF_MS 0 at once.
 *
 * One thread, epoll: written in C so that the load generator is not the
 * bottleneck (the Python one was: 1,280 gRPC streams in one process on the
 * cores the server also uses). Every attempt is written to `out` as one line
 * "<outcome> <latency us> <end us since the phase began>", outcome: ok,
 * refused, retry, or lost:<why>.
 *
 * Connections as HTTP clients keep them: a kept-alive connection the server
 * closed while the user was away is replaced before use; an answer with
 * "Connection: close" ends its connection; when a connection breaks, what the
 * server sent before it closed is read first (a refusal sent before the body
 * was read is a refusal, RFC 9112 9.5); a request on a kept-alive connection
 * that the server closed before any byte of an answer (it closed the
 * connection as the request left) is sent again at once on a new one and
 * recorded as `retry`. Lost is what got neither an answer nor a refusal.
 *
 *   overload_client HOST PORT MODEL USERS SECONDS BACKOFF_MS TIMEOUT_MS IMAGE OUT [openai] [expect]
 *
 * With THROTTLE_K in the environment (> 0; back-off users only) the users
 * share classify_describe's adaptive throttle (classify_describe/throttle.py,
 * the same rule and defaults: k, a 10 s fading window, from 20 requests on),
 * as the users of one client object do: an attempt refused by it is recorded
 * as `throttled`, never sent, and backed off like a refusal.
 *
 * With `openai` the same users speak to the OpenAI-compatible front instead:
 * POST /v1/chat/completions, the IMAGE as a base64 data URI and the prompt as
 * the text part; any 503 of the front (code service_unavailable: its shedding,
 * its body slots, Triton refusing it) is a refusal.
 *
 * With `expect` each request says "Expect: 100-continue" (RFC 9110 10.1.1) and
 * its body waits after the headers for the server's word, as curl's does: on
 * "100 Continue" the body goes; on a final answer (a refusal from the headers)
 * it never goes, and the connection is closed (the server cannot tell what
 * the next bytes would be); with neither within EXPECT_WAIT_S the body goes
 * anyway (curl's fallback, 1 s, for servers that ignore the expectation).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define REFUSED "Exceeds maximum queue size"
#define TIMED_OUT "Request timeout expired" /* the queue policy's time limit */
#define SHED "in-flight limit" /* deploy/nginx/triton-shed.conf.template's refusal */
#define FRONT_REFUSED "service_unavailable" /* openai_front's 503s */
#define OPENAI_TAIL "\"}]}]}" /* after the prompt: closes the text part, content, message, messages, body */
#define RETRY_AFTER_CAP_S 60.0 /* classify_describe.client.RETRY_AFTER_CAP_S */
#define PROMPT_FMT "What is it? (%08x-%010lu)"
#define PROMPT_LEN 33 /* the format above, always this long */
#define RECV_MAX (256 * 1024)
#define EXPECT_WAIT_S 1.0 /* curl's --expect100-timeout default */

/* WAITING: the headers of an `expect` request are sent, its body waits for the server's word. */
enum state { IDLE, SENDING, WAITING, READING, SLEEPING, DONE };

struct user {
    int fd, attempt;
    int answers; /* answers read on this connection: 0 on a new one */
    int resend;  /* the last attempt is to be sent again at once, even past the deadline */
    int go_on;   /* the body may be sent: no `expect`, or 100 Continue came, or EXPECT_WAIT_S passed */
    enum state state;
    char prompt[4 + PROMPT_LEN + 8]; /* the request's last part, its own */
    size_t sent, received;
    char *buf;
    double started, wake; /* wake: also the end of WAITING */
};

static struct sockaddr_in server;
static char *header_fmt, *image, *prefix; /* shared by every user: HTTP and JSON headers, the IMAGE */
static size_t image_len, prefix_len, request_len, prompt_part_len = 4 + PROMPT_LEN;
static size_t head_len; /* the HTTP headers at the start of prefix: all that goes before an `expect` wait */
static int openai_mode; /* 1: the OpenAI front's chat completions instead of Triton's infer */
static const char *expect_header = ""; /* "Expect: 100-continue\r\n" in `expect` mode */
static unsigned tag;
static unsigned long counter;
static double backoff_ms, timeout_ms, phase_start;
static double throttle_k; /* 0: no throttle */
static double throttle_requests, throttle_accepts, throttle_at;
#define THROTTLE_WINDOW_S 10.0
#define THROTTLE_MIN_REQUESTS 20.0
static FILE *out;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* One attempt: its outcome, its latency and when it ended (since the phase began). */
static void record(const char *outcome, double seconds) {
    fprintf(out, "%s %.0f %.0f\n", outcome, seconds * 1e6, (now() - phase_start) * 1e6);
}

static void put_u32(char *p, uint32_t v) {
    p[0] = v & 255; p[1] = (v >> 8) & 255; p[2] = (v >> 16) & 255; p[3] = (v >> 24) & 255;
}

/* The request: HTTP headers, the JSON inference header, then IMAGE and PROMPT
 * as BYTES tensors (a 4-byte little-endian length before each element). All
 * but the prompt is the same for every request: built once, shared. */
static void build_prefix(const char *model) {
    char json[512], head[512];
    int json_len = snprintf(json, sizeof json,
        "{\"inputs\":[{\"name\":\"IMAGE\",\"shape\":[1,1],\"datatype\":\"BYTES\",\"parameters\":"
        "{\"binary_data_size\":%zu}},{\"name\":\"PROMPT\",\"shape\":[1,1],\"datatype\":\"BYTES\","
        "\"parameters\":{\"binary_data_size\":%d}}]}", image_len + 4, PROMPT_LEN + 4);
    size_t body_len = json_len + 4 + image_len + 4 + PROMPT_LEN;
    head_len = snprintf(head, sizeof head, header_fmt, model, json_len, expect_header, body_len);
    prefix_len = head_len + json_len + 4;
    prefix = malloc(prefix_len);
    memcpy(prefix, head, head_len);
    memcpy(prefix + head_len, json, json_len);
    put_u32(prefix + head_len + json_len, image_len);
    request_len = prefix_len + image_len + 4 + PROMPT_LEN;
}

/* The OpenAI front's request: the photo first (a data URI), the prompt last, so that
 * only the last part differs per request; `image` becomes the base64 text and the
 * JSON up to the prompt. */
static void build_openai_prefix(const char *model) {
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const char *between = "\"}},{\"type\":\"text\",\"text\":\"";
    size_t between_len = strlen(between), encoded_len = 4 * ((image_len + 2) / 3);
    char *encoded = malloc(encoded_len + between_len);
    const unsigned char *in = (const unsigned char *)image;
    for (size_t i = 0, o = 0; i < image_len; i += 3) {
        uint32_t v = in[i] << 16 | (i + 1 < image_len ? in[i + 1] << 8 : 0) | (i + 2 < image_len ? in[i + 2] : 0);
        encoded[o++] = b64[v >> 18 & 63];
        encoded[o++] = b64[v >> 12 & 63];
        encoded[o++] = i + 1 < image_len ? b64[v >> 6 & 63] : '=';
        encoded[o++] = i + 2 < image_len ? b64[v & 63] : '=';
    }
    memcpy(encoded + encoded_len, between, between_len);
    image = encoded;
    image_len = encoded_len + between_len;
    prompt_part_len = PROMPT_LEN + strlen(OPENAI_TAIL);
    char json[512], head[512];
    int json_len = snprintf(json, sizeof json,
        "{\"model\":\"%s\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\","
        "\"image_url\":{\"url\":\"data:image/png;base64,", model);
    size_t body_len = json_len + image_len + prompt_part_len;
    head_len = snprintf(head, sizeof head, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        "Content-Type: application/json\r\n%sContent-Length: %zu\r\n\r\n", expect_header, body_len);
    prefix_len = head_len + json_len;
    prefix = malloc(prefix_len);
    memcpy(prefix, head, head_len);
    memcpy(prefix + head_len, json, json_len);
    request_len = prefix_len + image_len + prompt_part_len;
}

static void new_prompt(struct user *u) {
    char prompt[PROMPT_LEN + 12];
    snprintf(prompt, sizeof prompt, PROMPT_FMT, tag, counter++ % 10000000000UL);
    if (openai_mode) {
        memcpy(u->prompt, prompt, PROMPT_LEN);
        memcpy(u->prompt + PROMPT_LEN, OPENAI_TAIL, strlen(OPENAI_TAIL));
        return;
    }
    put_u32(u->prompt, PROMPT_LEN);
    memcpy(u->prompt + 4, prompt, PROMPT_LEN);
}

static int connect_user(struct user *u, int epoll_fd) {
    u->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(u->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(u->fd, (struct sockaddr *)&server, sizeof server) < 0 && errno != EINPROGRESS) {
        close(u->fd);
        u->fd = -1;
        return -1;
    }
    u->answers = 0;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLET, .data.ptr = u};
    return epoll_ctl(epoll_fd, EPOLL_CTL_ADD, u->fd, &ev);
}

static void drop_connection(struct user *u, int epoll_fd) {
    if (u->fd >= 0) {
        epoll_ctl(epoll_fd, EPOLL_CTL_DEL, u->fd, NULL);
        close(u->fd);
    }
    u->fd = -1;
}

/* Nothing to read and no error on an idle kept-alive connection: still usable
 * (a FIN reads as 0, a reset as an error), the check HTTP clients' pools make. */
static int still_open(int fd) {
    char byte;
    return recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) < 0 && errno == EAGAIN;
}

/* classify_describe/throttle.py's counts, fading with THROTTLE_WINDOW_S. */
static void throttle_decay(void) {
    double t = now(), factor = exp(-(t - throttle_at) / THROTTLE_WINDOW_S);
    throttle_requests *= factor;
    throttle_accepts *= factor;
    throttle_at = t;
}

/* Counts one attempt; 0: refused here, unsent. */
static int throttle_allow(void) {
    if (throttle_k <= 0) return 1;
    throttle_decay();
    double p = 0;
    if (throttle_requests >= THROTTLE_MIN_REQUESTS) {
        p = (throttle_requests - throttle_k * throttle_accepts) / (throttle_requests + 1);
        if (p < 0) p = 0;
    }
    throttle_requests += 1;
    return (double)rand() / ((double)RAND_MAX + 1) >= p;
}

static void throttle_accepted(void) {
    if (throttle_k <= 0) return;
    throttle_decay();
    throttle_accepts += 1;
}

static double jitter_s(int attempt) {
    double cap = backoff_ms * (double)(1 << (attempt < 20 ? attempt : 20));
    if (cap > 5000) cap = 5000;
    return (double)rand() / RAND_MAX * cap / 1000.0;
}

static void start_attempt(struct user *u, int epoll_fd) {
    if (!u->resend && !throttle_allow()) {
        record("throttled", 0);
        u->state = SLEEPING;
        u->wake = now() + jitter_s(u->attempt++);
        return;
    }
    if (u->fd >= 0 && !still_open(u->fd)) drop_connection(u, epoll_fd);
    u->resend = 0;
    if (u->fd < 0 && connect_user(u, epoll_fd) < 0) {
        record("lost:connect", 0);
        u->state = SLEEPING;
        u->wake = now() + 0.1;
        return;
    }
    new_prompt(u);
    u->sent = u->received = 0;
    u->go_on = !*expect_header;
    u->started = now();
    u->state = SENDING;
}

/* Interim answers (1xx) at the start of u->buf are taken out; 100 Continue lets the body go. */
static void take_interim(struct user *u) {
    char *end;
    while (u->received >= 12 && u->buf[9] == '1' && (end = strstr(u->buf, "\r\n\r\n"))) {
        if (atoi(u->buf + 9) == 100) u->go_on = 1;
        size_t length = end + 4 - u->buf;
        memmove(u->buf, u->buf + length, u->received - length);
        u->received -= length;
        u->buf[u->received] = 0;
    }
}

/* An answer is complete: -1 while more is to come, else its length. */
static long answer_length(struct user *u, int *status) {
    u->buf[u->received] = 0;
    take_interim(u);
    char *end = strstr(u->buf, "\r\n\r\n");
    if (!end) return -1;
    char *length = strcasestr(u->buf, "\r\ncontent-length:");
    if (!length || length > end) return -2;
    long total = (end + 4 - u->buf) + strtol(length + 17, NULL, 10);
    *status = atoi(u->buf + 9);
    return (long)u->received >= total ? total : -1;
}

/* A header of the answer in u->buf (name with its leading CRLF, lower case). */
static char *header(struct user *u, const char *name) {
    char *found = strcasestr(u->buf, name), *end = strstr(u->buf, "\r\n\r\n");
    return found && found < end ? found : NULL;
}

static void finish(struct user *u, int status, int epoll_fd) {
    double seconds = now() - u->started;
    u->answers++;
    /* The next attempt connects anew; also after an answer that came before the body
     * went (`expect`): the server cannot tell whether the next bytes are that body. */
    if (header(u, "\r\nconnection: close") || u->sent < request_len) drop_connection(u, epoll_fd);
    if (status == 200) {
        throttle_accepted();
        record("ok", seconds);
        u->attempt = 0;
        u->state = IDLE;
    } else if (status == 503 && (strstr(u->buf, REFUSED) || strstr(u->buf, TIMED_OUT) || strstr(u->buf, SHED) ||
                                 (openai_mode && strstr(u->buf, FRONT_REFUSED)))) {
        record("refused", seconds);
        u->state = SLEEPING;
        double wait = jitter_s(u->attempt++);
        /* Clients that back off also honour Retry-After (capped); those that
         * resend at once (BACKOFF_MS 0) ignore it, which is their point. */
        char *retry_after = header(u, "\r\nretry-after:");
        if (retry_after && backoff_ms > 0) {
            double asked = atof(retry_after + 14);
            if (asked > RETRY_AFTER_CAP_S) asked = RETRY_AFTER_CAP_S;
            if (asked > wait) wait = asked;
        }
        u->wake = now() + wait;
    } else {
        char why[32];
        snprintf(why, sizeof why, "lost:http_%d", status);
        record(why, seconds);
        drop_connection(u, epoll_fd);
        u->state = IDLE;
    }
}

static void fail(struct user *u, const char *why, int epoll_fd) {
    record(why, now() - u->started);
    drop_connection(u, epoll_fd);
    u->state = SLEEPING;
    u->wake = now() + 0.1;
}

/* The connection failed (a send or read error, or closed) before the answer was whole;
 * `why` is the step, the error's name is added to it. */
static void broken(struct user *u, const char *step, int error, int epoll_fd) {
    char why[48];
    snprintf(why, sizeof why, "%s%s%s", step, error ? ":" : "", error ? strerrorname_np(error) : "");
    /* What the server sent before it closed is still there to read. */
    for (ssize_t n = 1; n > 0 && u->received < RECV_MAX - 1;) {
        n = recv(u->fd, u->buf + u->received, RECV_MAX - 1 - u->received, MSG_DONTWAIT);
        if (n > 0) u->received += n;
    }
    int status = 0;
    if (u->received && answer_length(u, &status) >= 0) {
        finish(u, status, epoll_fd);
        drop_connection(u, epoll_fd);
        return;
    }
    if (u->received == 0 && u->answers > 0) {
        /* Closed by the server as the request left, on a connection that had
         * answered before: not an answer the server gave, so sent again at once
         * on a new connection (which, failing so, is lost). */
        record("retry", now() - u->started);
        drop_connection(u, epoll_fd);
        u->state = IDLE;
        u->resend = 1;
        return;
    }
    fail(u, why, epoll_fd);
}

/* A timeout's reason names the step the attempt was stuck in, and whether on a
 * new connection (that had not answered yet). */
static const char *timeout_reason(struct user *u) {
    static char why[64];
    const char *step = u->state == SENDING   ? (u->sent ? "sending" : "unsent")
                       : u->state == WAITING ? "expecting"
                                             : (u->received ? "reading" : "unanswered");
    snprintf(why, sizeof why, "lost:timeout:%s%s", step, u->answers ? "" : ":new");
    return why;
}

/* The unsent rest of the request up to `end`, from the three parts. */
static int pending(struct user *u, size_t end, struct iovec *iov) {
    const char *parts[3] = {prefix, image, u->prompt};
    size_t lengths[3] = {prefix_len, image_len, prompt_part_len};
    size_t skip = u->sent, left = end - u->sent;
    int count = 0;
    for (int i = 0; i < 3 && left; i++) {
        if (skip >= lengths[i]) {
            skip -= lengths[i];
            continue;
        }
        size_t length = lengths[i] - skip < left ? lengths[i] - skip : left;
        iov[count].iov_base = (char *)parts[i] + skip;
        iov[count++].iov_len = length;
        left -= length;
        skip = 0;
    }
    return count;
}

static void do_send(struct user *u, int epoll_fd) {
    size_t end = u->go_on ? request_len : head_len; /* `expect`: the headers, then the server's word */
    while (u->sent < end) {
        struct iovec iov[3];
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = pending(u, end, iov)};
        ssize_t n = sendmsg(u->fd, &msg, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno != EAGAIN) broken(u, "lost:send", errno, epoll_fd);
            return;
        }
        u->sent += n;
    }
    if (u->go_on) {
        u->state = READING;
    } else {
        u->state = WAITING;
        u->wake = now() + EXPECT_WAIT_S;
    }
}

static void do_read(struct user *u, int epoll_fd) {
    for (;;) {
        ssize_t n = recv(u->fd, u->buf + u->received, RECV_MAX - 1 - u->received, 0);
        if (n == 0) return broken(u, "lost:closed", 0, epoll_fd);
        if (n < 0) {
            if (errno != EAGAIN) broken(u, "lost:recv", errno, epoll_fd);
            return;
        }
        u->received += n;
        int status = 0;
        long length = answer_length(u, &status);
        if (length == -2 || u->received >= RECV_MAX - 1) return fail(u, "lost:unparsed", epoll_fd);
        if (length >= 0) return finish(u, status, epoll_fd);
        if (u->state == WAITING && u->go_on) { /* 100 Continue: the body goes, then its answer is read */
            u->state = SENDING;
            do_send(u, epoll_fd);
            if (u->state != READING) return;
        }
    }
}

/* On an epoll event (or a new attempt): the user's I/O, until it would block. */
static void step(struct user *u, int epoll_fd, double deadline) {
    if (u->state == IDLE) {
        if (now() >= deadline && !u->resend) {
            u->state = DONE;
            return;
        }
        start_attempt(u, epoll_fd);
    }
    if (u->state == SENDING) do_send(u, epoll_fd);
    if (u->state == READING || u->state == WAITING) do_read(u, epoll_fd);
}

/* Every few ms, without I/O: back-offs that are over, attempts past the timeout. */
static void tick(struct user *u, int epoll_fd, double deadline, double t) {
    if (u->state == SLEEPING && t >= u->wake) u->state = IDLE;
    if ((u->state == SENDING || u->state == WAITING || u->state == READING) && t - u->started > timeout_ms / 1000)
        fail(u, timeout_reason(u), epoll_fd);
    if (u->state == WAITING && t >= u->wake) { /* no word from the server: the body goes anyway */
        u->go_on = 1;
        u->state = SENDING;
        step(u, epoll_fd, deadline);
    }
    if (u->state == IDLE) step(u, epoll_fd, deadline);
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *len = ftell(f);
    rewind(f);
    char *data = malloc(*len);
    if (fread(data, 1, *len, f) != *len) *len = 0;
    fclose(f);
    return data;
}

static void raise_fd_limit(void) {
    struct rlimit limit;
    getrlimit(RLIMIT_NOFILE, &limit);
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
}

static int run(struct user *users, int count, double seconds) {
    int epoll_fd = epoll_create1(0);
    phase_start = now();
    double deadline = phase_start + seconds;
    struct epoll_event events[256];
    int active = count;
    while (active) {
        int n = epoll_wait(epoll_fd, events, 256, 2);
        for (int i = 0; i < n; i++) step(events[i].data.ptr, epoll_fd, deadline);
        double t = now();
        active = 0;
        for (int i = 0; i < count; i++) {
            if (users[i].state != DONE) tick(&users[i], epoll_fd, deadline, t);
            active += users[i].state != DONE;
        }
    }
    for (int i = 0; i < count; i++) drop_connection(&users[i], epoll_fd);
    return 0;
}

int main(int argc, char **argv) {
    int usage = argc < 10;
    for (int i = 10; i < argc; i++) {
        if (strcmp(argv[i], "openai") == 0)
            openai_mode = 1;
        else if (strcmp(argv[i], "expect") == 0)
            expect_header = "Expect: 100-continue\r\n";
        else
            usage = 1;
    }
    if (usage) {
        fprintf(stderr, "usage: %s HOST PORT MODEL USERS SECONDS BACKOFF_MS TIMEOUT_MS IMAGE OUT [openai] [expect]\n", argv[0]);
        return 2;
    }
    server.sin_family = AF_INET;
    server.sin_port = htons(atoi(argv[2]));
    inet_pton(AF_INET, argv[1], &server.sin_addr);
    int count = atoi(argv[4]);
    backoff_ms = atof(argv[6]);
    timeout_ms = atof(argv[7]);
    image = read_file(argv[8], &image_len);
    out = fopen(argv[9], "w");
    const char *k = getenv("THROTTLE_K");
    throttle_k = k && backoff_ms > 0 ? atof(k) : 0;
    if (!image || !image_len || !out || count < 1) {
        fprintf(stderr, "overload_client: cannot read %s or write %s\n", argv[8], argv[9]);
        return 2;
    }
    raise_fd_limit();
    srand(getpid() ^ (unsigned)time(NULL));
    tag = (unsigned)rand();
    header_fmt = "POST /v2/models/%s/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 "Content-Type: application/octet-stream\r\nInference-Header-Content-Length: %d\r\n"
                 "%sContent-Length: %zu\r\n\r\n";
    if (openai_mode)
        build_openai_prefix(argv[3]);
    else
        build_prefix(argv[3]);
    struct user *users = calloc(count, sizeof *users);
    for (int i = 0; i < count; i++) {
        users[i].fd = -1;
        users[i].buf = malloc(RECV_MAX);
    }
    run(users, count, atof(argv[5]));
    fclose(out);
    return 0;
}
