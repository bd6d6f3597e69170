"""Streaming consumer example: a queue into Parquet files, exactly once per checkpoint.

    .venv/bin/python -m spark.examples.streaming_job [--url sqlite:///keygate-demo.db]
        [--queue demo-orders] [--group archive] [--out keygate-demo-out] [--follow]

With an empty queue it first seeds 1,000 demo messages. Without ``--follow`` the query
runs with ``trigger(availableNow=True)``: it archives everything stored now, in
micro-batches of at most 250 messages, and stops; run it again and it continues from its
checkpoint (``<out>/checkpoint``), committing the group's progress in SQL. With
``--follow`` it keeps running (one micro-batch per second) until interrupted.
"""

from __future__ import annotations

from pathlib import Path

from spark.examples.demo import arguments, local_session


def main() -> None:
    parser = arguments(__doc__, group="archive")
    parser.add_argument("--out", type=Path, default=Path("keygate-demo-out"))
    parser.add_argument("--follow", action="store_true")
    args = parser.parse_args()
    session = local_session("keygate-streaming-example", args.url, args.queue)
    try:
        stream = (
            session.readStream.format("keygate")
            .option("url", args.url)
            .option("queue", args.queue)
            .option("group", args.group)
            .option("maxOffsetsPerTrigger", "250")
            .load()
        )
        writer = (
            stream.writeStream.format("parquet")
            .option("checkpointLocation", str(args.out / "checkpoint"))
            .partitionBy("partition")
        )
        if args.follow:
            writer = writer.trigger(processingTime="1 second")
        else:
            writer = writer.trigger(availableNow=True)
        query = writer.start(str(args.out / "data"))
        try:
            query.awaitTermination()
        except KeyboardInterrupt:
            query.stop()
        for progress in query.recentProgress:
            print(f"batch {progress['batchId']}: {progress['numInputRows']} messages")
        archived = session.read.parquet(str(args.out / "data")).count()
        print(f"{archived} messages archived under {args.out / 'data'}")
    finally:
        session.stop()


if __name__ == "__main__":
    main()
